"""The VPC: public subnets (NAT only), private subnets with egress (Batch media workers, and
functions that must fetch from the internet, such as the api probing input URLs), and isolated
subnets (Aurora, RDS Proxy, Redis, every other function). VPC endpoints for S3 (gateway), SQS,
Step Functions, Secrets Manager, CloudWatch Logs, CloudWatch Monitoring, X-Ray and Batch mean no function
needs a NAT to reach AWS."""
from __future__ import annotations

from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_logs as logs
from constructs import Construct

from infra_cdk.stages import StageConfig

INTERFACE_ENDPOINTS = {
    "Sqs": ec2.InterfaceVpcEndpointAwsService.SQS,
    "StepFunctions": ec2.InterfaceVpcEndpointAwsService.STEP_FUNCTIONS,
    "SecretsManager": ec2.InterfaceVpcEndpointAwsService.SECRETS_MANAGER,
    "Ssm": ec2.InterfaceVpcEndpointAwsService.SSM,  # the platform config parameter, from isolated subnets
    "Logs": ec2.InterfaceVpcEndpointAwsService.CLOUDWATCH_LOGS,
    "Monitoring": ec2.InterfaceVpcEndpointAwsService.CLOUDWATCH_MONITORING,
    "XRay": ec2.InterfaceVpcEndpointAwsService.XRAY,
    "Batch": ec2.InterfaceVpcEndpointAwsService.BATCH,  # media jobs: submitted and described from isolated subnets
}

VPC_CIDR = "10.40.0.0/16"
ISOLATED = ec2.SubnetSelection(subnet_type=ec2.SubnetType.PRIVATE_ISOLATED)
EGRESS = ec2.SubnetSelection(subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS)


class Network(Construct):
    def __init__(self, scope: Construct, cid: str, *, stage: StageConfig) -> None:
        super().__init__(scope, cid)
        self.vpc = ec2.Vpc(
            self, "Vpc",
            vpc_name=stage.prefix,
            ip_addresses=ec2.IpAddresses.cidr(VPC_CIDR),
            max_azs=stage.max_azs,
            nat_gateways=stage.nat_gateways,
            restrict_default_security_group=False,  # True adds a custom-resource Lambda; the default SG is unused
            subnet_configuration=[
                ec2.SubnetConfiguration(name="public", subnet_type=ec2.SubnetType.PUBLIC, cidr_mask=24),
                ec2.SubnetConfiguration(name="egress", subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS, cidr_mask=20),
                ec2.SubnetConfiguration(name="isolated", subnet_type=ec2.SubnetType.PRIVATE_ISOLATED, cidr_mask=22),
            ],
        )
        flow_logs = logs.LogGroup(self, "FlowLogs", retention=stage.log_retention, removal_policy=stage.removal_policy)
        self.vpc.add_flow_log(
            "FlowLog",
            destination=ec2.FlowLogDestination.to_cloud_watch_logs(flow_logs),
            traffic_type=ec2.FlowLogTrafficType.ALL if stage.flow_log_all_traffic else ec2.FlowLogTrafficType.REJECT,
        )
        self.s3_endpoint = self.vpc.add_gateway_endpoint(
            "S3", service=ec2.GatewayVpcEndpointAwsService.S3, subnets=[ISOLATED, EGRESS])
        # One security group for the interface endpoints: HTTPS from inside the VPC only.
        self.endpoint_sg = ec2.SecurityGroup(self, "EndpointSg", vpc=self.vpc, allow_all_outbound=False,
                                             description="VPC interface endpoints: HTTPS from the VPC")
        self.endpoint_sg.add_ingress_rule(ec2.Peer.ipv4(VPC_CIDR), ec2.Port.tcp(443),
                                          "HTTPS from the VPC to AWS APIs")
        self.endpoints = {
            name: self.vpc.add_interface_endpoint(
                name, service=service, subnets=ISOLATED, private_dns_enabled=True,
                security_groups=[self.endpoint_sg], open=False)
            for name, service in INTERFACE_ENDPOINTS.items()
        }
