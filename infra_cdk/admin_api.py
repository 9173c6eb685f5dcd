"""The admin API's own API Gateway (REST, regional) in front of the `admin_api` function: the
operator plane (docs/admin-api.md) and its dashboard, apart from the tenant API so that its
throttle, logs and concurrency are its own and a tenant flood never reaches it.

- Paths: only /admin/{proxy+}, /dashboard and /dashboard/{proxy+} are integrated (proxy, every
  method); anything else answers API Gateway's own 403 without invoking the function. The tenant
  API (infra_cdk/api.py) proxies everything to the `api` function, which has no /admin route.
- Authentication: the in-handler operator-token check (functions/admin_api/access.py:
  `Authorization: Bearer avop_...` or the dashboard's session cookie, hashed and looked up in
  PostgreSQL, then the route's permission against the operator's role; denials are audited).
- Throttling: its own stage-wide rate and burst limits (StageConfig.admin_api_*).
- Request size: the tenant API's WAF web ACL is associated with this stage too (body-size,
  per-IP rate, AWS managed rules); the handler enforces the same body limit.
- Access logs to their own CloudWatch Logs group in JSON, execution logging at ERROR, X-Ray."""
from __future__ import annotations

from aws_cdk import aws_apigateway as apigw
from aws_cdk import aws_logs as logs
from aws_cdk import aws_wafv2 as wafv2
from constructs import Construct, IConstruct

from infra_cdk.api import add_gateway_responses
from infra_cdk.functions import AppFunction
from infra_cdk.nag import suppress
from infra_cdk.stages import StageConfig

ADMIN_PATH_ROOTS = ("admin", "dashboard")  # aivedio_tools.local.handlers.ADMIN_API_PREFIXES, without the slash


class AdminApi(Construct):
    def __init__(self, scope: Construct, cid: str, *, stage: StageConfig, fn: AppFunction,
                 web_acl: wafv2.CfnWebACL, cloud_watch_account: IConstruct | None = None) -> None:
        super().__init__(scope, cid)
        access_logs = logs.LogGroup(self, "AccessLogs", retention=stage.log_retention, removal_policy=stage.removal_policy)
        self.api = apigw.RestApi(
            self, "RestApi",
            rest_api_name=f"{stage.prefix}-admin-api",
            description="AiVedio admin API (operators) and operations dashboard",
            endpoint_types=[apigw.EndpointType.REGIONAL],
            # The account's API Gateway CloudWatch role is set once, by the tenant API (infra_cdk/api.py);
            # a second AWS::ApiGateway::Account here would fight over the same account setting.
            cloud_watch_role=False,
            deploy_options=apigw.StageOptions(
                stage_name=stage.name,
                throttling_rate_limit=stage.admin_api_rate_limit,
                throttling_burst_limit=stage.admin_api_burst_limit,
                access_log_destination=apigw.LogGroupLogDestination(access_logs),
                access_log_format=apigw.AccessLogFormat.json_with_standard_fields(
                    caller=False, http_method=True, ip=True, protocol=True, request_time=True, resource_path=True,
                    response_length=True, status=True, user=False),
                logging_level=apigw.MethodLoggingLevel.ERROR,
                data_trace_enabled=False,  # request bodies carry operator tokens and issued secrets
                tracing_enabled=True,
                metrics_enabled=True,
            ),
        )
        if cloud_watch_account is not None:  # execution logging needs the account's role set first
            self.api.deployment_stage.node.add_dependency(cloud_watch_account)
        self.validator = self.api.add_request_validator(
            "Validator", request_validator_name="parameters", validate_request_parameters=True,
            validate_request_body=False)
        integration = apigw.LambdaIntegration(fn.function, proxy=True)
        options = apigw.MethodOptions(request_validator=self.validator)
        for root in ADMIN_PATH_ROOTS:
            resource = self.api.root.add_resource(root)
            if root == "dashboard":  # the page itself is /dashboard
                resource.add_method("ANY", integration, request_validator=self.validator)
            resource.add_proxy(default_integration=integration, any_method=True, default_method_options=options)

        add_gateway_responses(self.api)  # API Gateway's own answers in the API's error shape, as the tenant API's
        wafv2.CfnWebACLAssociation(self, "WebAclAssociation", resource_arn=self.api.deployment_stage.stage_arn,
                                   web_acl_arn=web_acl.attr_arn)

        suppress(self.api, ("AwsSolutions-APIG2", "The validator checks parameters only. Bodies are validated by the "
                                                  "admin handler's pydantic models, which answer 422 naming each field "
                                                  "in the API's error shape; body size is limited by WAF."))
        suppress(self.api, ("AwsSolutions-APIG4", "Operators authenticate in the handler with their operator token "
                                                  "(Authorization: Bearer avop_... or the dashboard's HttpOnly session "
                                                  "cookie, checked against PostgreSQL in functions/admin_api/access.py), "
                                                  "and every route is checked against the operator's role there."),
                 ("AwsSolutions-COG4", "No Cognito: operators hold platform-issued tokens (aivedio admin operator "
                                       "create), hashed in PostgreSQL and revocable, verified on every request."),
                 children=True)
