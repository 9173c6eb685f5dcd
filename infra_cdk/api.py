"""API Gateway (REST, regional) in front of the `api` function, proxy integration on `/` and
`/{proxy+}`.

- Authentication: the in-handler API-key check (functions/api/routes/auth.py: `Authorization:
  Bearer <key>` verified against PostgreSQL, tenant status included). API Gateway does not
  authenticate, so the tenant API keys never need to be mirrored into API Gateway.
- Throttling: stage-wide rate and burst limits, and a usage plan carrying the same throttle and a
  daily quota. Per-tenant limits are the handler's token buckets (aivedio.admission.rate_limits),
  because clients are identified by their bearer key, not by API Gateway API keys.
- Request size: API Gateway's own limit is 10 MB and cannot be lowered, so a WAF web ACL blocks
  bodies over Limits.max_body_bytes (64 KiB) at the edge (body inspection set to the same size);
  the handler enforces the same limit with a 413 (defence in depth, and locally).
- Request validation: a validator checks required parameters; bodies are validated by the
  handler's pydantic models (APIGatewayRestResolver(enable_validation=True)), one place only.
- Access logs to CloudWatch Logs in JSON, execution logging at ERROR, X-Ray tracing.
- API Gateway's own answers (its throttling 429, its 413, a timeout's 504, any other 4xx/5xx it
  gives) and the WAF's blocks answer in the API's error shape, from aivedio.gateway_errors, the
  table the local server answers from too; `add_gateway_responses` does the same for the admin API."""
from __future__ import annotations

import json

from aws_cdk import RemovalPolicy
from aws_cdk import aws_apigateway as apigw
from aws_cdk import aws_logs as logs
from aws_cdk import aws_wafv2 as wafv2
from constructs import Construct

from aivedio import gateway_errors
from aivedio.config import Limits
from infra_cdk.functions import AppFunction
from infra_cdk.nag import suppress
from infra_cdk.stages import StageConfig

WAF_BODY_LIMITS_KB = (16, 32, 48, 64)  # what WAF can inspect of an API Gateway request body


def add_gateway_responses(api: apigw.RestApi) -> None:
    """Every response API Gateway gives on its own, in the API's error shape (aivedio.gateway_errors)."""
    for response_type, error in gateway_errors.GATEWAY_ERRORS.items():
        headers = {"Content-Type": "'application/json'", "x-amzn-ErrorType": f"'{error.code}'"}
        if error.retry_after_seconds is not None:
            headers["Retry-After"] = f"'{error.retry_after_seconds}'"
        api.add_gateway_response(
            f"Gateway{''.join(w.title() for w in response_type.split('_'))}",
            type=apigw.ResponseType.of(response_type),
            status_code=None if error.status is None else str(error.status),
            response_headers=headers,
            templates={"application/json": gateway_errors.response_template(error)})


def waf_block(rule: str) -> wafv2.CfnWebACL.RuleActionProperty:
    """A WAF rule's block, answered in the API's error shape (its body under the rule's name in
    the ACL's custom_response_bodies)."""
    error = gateway_errors.WAF_BLOCKS[rule]
    headers = ([wafv2.CfnWebACL.CustomHTTPHeaderProperty(name="Retry-After", value=str(error.retry_after_seconds))]
               if error.retry_after_seconds is not None else None)  # as the gateway's own 429 says when to come back
    return wafv2.CfnWebACL.RuleActionProperty(block=wafv2.CfnWebACL.BlockActionProperty(
        custom_response=wafv2.CfnWebACL.CustomResponseProperty(response_code=error.status, custom_response_body_key=rule,
                                                               response_headers=headers)))


def waf_response_bodies() -> dict[str, wafv2.CfnWebACL.CustomResponseBodyProperty]:
    return {rule: wafv2.CfnWebACL.CustomResponseBodyProperty(content_type="APPLICATION_JSON",
                                                              content=json.dumps(gateway_errors.body(error)))
            for rule, error in gateway_errors.WAF_BLOCKS.items()}


def body_inspection_limit(max_body_bytes: int) -> str:
    for kb in WAF_BODY_LIMITS_KB:
        if max_body_bytes <= kb * 1024:
            return f"KB_{kb}"
    raise ValueError(f"max_body_bytes {max_body_bytes} is over what WAF inspects ({WAF_BODY_LIMITS_KB[-1]} KB); "
                     "the size rule would need OversizeHandling=CONTINUE and the handler alone would enforce it")


class Api(Construct):
    def __init__(self, scope: Construct, cid: str, *, stage: StageConfig, fn: AppFunction) -> None:
        super().__init__(scope, cid)
        access_logs = logs.LogGroup(self, "AccessLogs", retention=stage.log_retention, removal_policy=stage.removal_policy)
        self.api = apigw.RestApi(
            self, "RestApi",
            rest_api_name=f"{stage.prefix}-api",
            description="AiVedio tenant API",
            endpoint_types=[apigw.EndpointType.REGIONAL],
            # The CloudWatch role is an account-wide API Gateway setting that every stage's stack
            # points at; it is retained so deleting one stage never breaks another's logging.
            cloud_watch_role=True,
            cloud_watch_role_removal_policy=RemovalPolicy.RETAIN,
            # The stage is named after the platform stage: https://<id>.execute-api.<region>.amazonaws.com/dev/v1/...
            # (a custom domain's base path mapping would hide it).
            deploy_options=apigw.StageOptions(
                stage_name=stage.name,
                throttling_rate_limit=stage.api_rate_limit,
                throttling_burst_limit=stage.api_burst_limit,
                access_log_destination=apigw.LogGroupLogDestination(access_logs),
                access_log_format=apigw.AccessLogFormat.json_with_standard_fields(
                    caller=False, http_method=True, ip=True, protocol=True, request_time=True, resource_path=True,
                    response_length=True, status=True, user=False),
                logging_level=apigw.MethodLoggingLevel.ERROR,
                data_trace_enabled=False,
                tracing_enabled=True,
                metrics_enabled=True,
            ),
        )
        self.validator = self.api.add_request_validator(
            "Validator", request_validator_name="parameters", validate_request_parameters=True,
            validate_request_body=False)
        integration = apigw.LambdaIntegration(fn.function, proxy=True)
        options = {"request_validator": self.validator}
        self.api.root.add_method("ANY", integration, **options)
        self.api.root.add_proxy(default_integration=integration, any_method=True,
                                default_method_options=apigw.MethodOptions(request_validator=self.validator))

        self.usage_plan = self.api.add_usage_plan(
            "UsagePlan", name=f"{stage.prefix}-default",
            description="Stage-wide ceiling; per-tenant limits are enforced in the handler",
            throttle=apigw.ThrottleSettings(rate_limit=stage.api_rate_limit, burst_limit=stage.api_burst_limit),
            quota=apigw.QuotaSettings(limit=stage.api_quota_per_day, period=apigw.Period.DAY),
            api_stages=[apigw.UsagePlanPerApiStage(api=self.api, stage=self.api.deployment_stage)],
        )
        add_gateway_responses(self.api)
        self.web_acl = self._waf(stage)

        suppress(self.api, ("AwsSolutions-APIG2", "The validator checks parameters only. Bodies are validated by the "
                                                  "handler's pydantic models, which answer in the API's error shape "
                                                  "{error, message, details}; an API Gateway model would answer in its "
                                                  "own shape, and body size is limited by WAF."))
        suppress(self.api, ("AwsSolutions-APIG4", "Callers authenticate in the handler with their tenant API key "
                                                  "(Authorization: Bearer, checked against PostgreSQL in "
                                                  "functions/api/routes/auth.py); webhooks carry provider signatures."),
                 ("AwsSolutions-COG4", "No Cognito: tenants are machine clients with API keys issued by the platform, "
                                       "verified by the handler on every request."),
                 children=True)
        suppress(self.api, ("AwsSolutions-IAM4", "API Gateway's account-level CloudWatch role needs the AWS managed "
                                                 "AmazonAPIGatewayPushToCloudWatchLogs policy (access and execution logs).",
                            ["Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AmazonAPIGatewayPushToCloudWatchLogs"]),
                 children=True)

    def _waf(self, stage: StageConfig) -> wafv2.CfnWebACL:
        max_body = Limits().max_body_bytes

        def visibility(name: str) -> wafv2.CfnWebACL.VisibilityConfigProperty:
            return wafv2.CfnWebACL.VisibilityConfigProperty(
                cloud_watch_metrics_enabled=True, metric_name=f"{stage.prefix}-{name}", sampled_requests_enabled=True)

        rules = [
            wafv2.CfnWebACL.RuleProperty(
                name="body-size", priority=0, action=waf_block("body-size"),
                statement=wafv2.CfnWebACL.StatementProperty(size_constraint_statement=wafv2.CfnWebACL.SizeConstraintStatementProperty(
                    field_to_match=wafv2.CfnWebACL.FieldToMatchProperty(body=wafv2.CfnWebACL.BodyProperty(oversize_handling="MATCH")),
                    comparison_operator="GT", size=max_body,
                    text_transformations=[wafv2.CfnWebACL.TextTransformationProperty(priority=0, type="NONE")])),
                visibility_config=visibility("body-size")),
            wafv2.CfnWebACL.RuleProperty(
                name="rate-per-ip", priority=1, action=waf_block("rate-per-ip"),
                statement=wafv2.CfnWebACL.StatementProperty(rate_based_statement=wafv2.CfnWebACL.RateBasedStatementProperty(
                    limit=stage.waf_rate_limit_per_ip, aggregate_key_type="IP")),
                visibility_config=visibility("rate-per-ip")),
            wafv2.CfnWebACL.RuleProperty(
                name="aws-common", priority=2, override_action=wafv2.CfnWebACL.OverrideActionProperty(none={}),
                statement=wafv2.CfnWebACL.StatementProperty(managed_rule_group_statement=wafv2.CfnWebACL.ManagedRuleGroupStatementProperty(
                    vendor_name="AWS", name="AWSManagedRulesCommonRuleSet",
                    # Its 8 KB body rule would refuse legitimate requests; body-size above applies ours.
                    rule_action_overrides=[wafv2.CfnWebACL.RuleActionOverrideProperty(
                        name="SizeRestrictions_BODY", action_to_use=wafv2.CfnWebACL.RuleActionProperty(count={}))])),
                visibility_config=visibility("aws-common")),
            wafv2.CfnWebACL.RuleProperty(
                name="aws-known-bad-inputs", priority=3, override_action=wafv2.CfnWebACL.OverrideActionProperty(none={}),
                statement=wafv2.CfnWebACL.StatementProperty(managed_rule_group_statement=wafv2.CfnWebACL.ManagedRuleGroupStatementProperty(
                    vendor_name="AWS", name="AWSManagedRulesKnownBadInputsRuleSet")),
                visibility_config=visibility("aws-known-bad-inputs")),
        ]
        acl = wafv2.CfnWebACL(
            self, "WebAcl", name=f"{stage.prefix}-api", scope="REGIONAL",
            default_action=wafv2.CfnWebACL.DefaultActionProperty(allow={}),
            visibility_config=visibility("api"),
            custom_response_bodies=waf_response_bodies(),
            association_config=wafv2.CfnWebACL.AssociationConfigProperty(request_body={
                "API_GATEWAY": wafv2.CfnWebACL.RequestBodyAssociatedResourceTypeConfigProperty(
                    default_size_inspection_limit=body_inspection_limit(max_body))}),
            rules=rules,
        )
        wafv2.CfnWebACLAssociation(self, "WebAclAssociation", resource_arn=self.api.deployment_stage.stage_arn,
                                   web_acl_arn=acl.attr_arn)
        return acl
