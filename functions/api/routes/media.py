"""GET /v1/media/<ref>: the platform's own URLs of a task's outputs, served locally (`aivedio serve`;
in AWS the tenant gets presigned S3 URLs instead, aivedio.media.urls). No bearer key: the URL is
the credential. Its signature (HMAC with a key random per process) and its expiry are checked
first; a tampered, foreign or expired URL answers 403 and reads nothing."""
from __future__ import annotations

from typing import Annotated

from aws_lambda_powertools.event_handler import Response
from aws_lambda_powertools.event_handler.openapi.params import Query
from aws_lambda_powertools.event_handler.router import APIGatewayRouter

from aivedio.context import get_platform
from aivedio.media import urls
from aivedio.media.pipeline import content_type_of
from functions._edge.errors import register_status
from functions.api.routes.schemas import ErrorBody, errors

router = APIGatewayRouter()
register_status(MEDIA_URL_REFUSED=403)


@router.get("/v1/media/<ref>", tags=["media"], summary="A task output, by the signed URL its task view gave",
            responses={200: {"description": "the object's bytes", "content": {"application/octet-stream": {}}},
                       **errors(404, 413, 422),
                       403: {"description": "a tampered, foreign or expired URL (MEDIA_URL_REFUSED)",
                             "content": {"application/json": {"model": ErrorBody}}}})
def get_media(ref: str, expires: Annotated[str, Query(max_length=20)] = "",
              sig: Annotated[str, Query(max_length=100)] = ""):
    platform = get_platform()
    key = urls.verify(platform, ref, expires, sig)
    path = urls.local_path(platform, key)
    return Response(status_code=200, content_type=content_type_of(key), body=path.read_bytes(),
                    headers={"Cache-Control": "private, max-age=300"})
