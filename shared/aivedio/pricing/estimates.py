"""Server-side normalisation and estimates (ch. 18.7). Everything here is derived from the model,
mode, duration, resolution, audio and the *probed* inputs; nothing a client declares is trusted.

fairness_units = max(provider seconds / 30, provider cost / cost base, GPU seconds / 30), rounded up:
the task's dominant bottleneck, used only for fairness between tenants. Each resource is still
limited on its own dimension (provider slots, GPU, media units, cost)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from typing import TYPE_CHECKING

from aivedio.config import RESOLUTIONS, PlatformConfig
from aivedio.errors import InvalidRequest

if TYPE_CHECKING:  # the request and its probed inputs, which admission passes in: types only
    from aivedio.admission.models import GenerationRequest
    from aivedio.media.probe import ProbedMedia

ESTIMATE_VERSION = 1

PROVIDER_SECONDS_PER_OUTPUT_SECOND = 6
RESOLUTION_FACTOR = {"480p": Decimal("0.5"), "720p": Decimal(1), "1080p": Decimal(2), "4k": Decimal(6)}
MODE_FACTOR = {"text_to_video": Decimal(1), "image_to_video": Decimal(1), "video_to_video": Decimal("1.5"), "extend": Decimal(1)}
AUDIO_FACTOR = Decimal("1.2")
PROVIDER_SECOND_BASE = Decimal(30)
COST_BASE = Decimal("0.25")  # provider currency per fairness unit
GPU_SECOND_BASE = Decimal(30)
MEDIA_UNITS = {"480p": 1, "720p": 1, "1080p": 2, "4k": 6}  # ch. 18.5.4 transcode CPU units
GPU_UNITS = {"480p": 0, "720p": 0, "1080p": 1, "4k": 2}
EXPENSIVE_DURATION_SECONDS = 30
# Every resource_class estimate() derives (an operator switches each on or off: aivedio.admin.capacity).
RESOURCE_CLASSES = ("video-standard", "video-4k", "video-v2v")
INPUT_KIND_BY_MODE = {"image_to_video": "image", "video_to_video": "video", "extend": "video"}
PRIORITY_BAND = {  # (service class, interactive) -> band; P0 is kept for recovery work
    ("ENTERPRISE_RESERVED", True): 1, ("ENTERPRISE_RESERVED", False): 2,
    ("PAID_SHARED", True): 2, ("PAID_SHARED", False): 3,
    ("STANDARD", True): 3, ("STANDARD", False): 3,
    ("BEST_EFFORT", True): 4, ("BEST_EFFORT", False): 4,
}


@dataclass(frozen=True)
class Estimate:
    model: str
    mode: str
    duration_seconds: int
    resolution: str
    with_audio: bool
    interactive: bool
    input_seconds: float
    fairness_units: int
    provider_slot_units: int
    gpu_units: int
    media_units: int
    estimated_cost: Decimal
    cost_currency: str
    estimated_cost_units: int
    resource_class: str
    queue_class: str
    priority_band: int
    is_expensive: bool
    estimate_version: int = ESTIMATE_VERSION

    def normalized_params(self) -> dict:
        d = dict(vars(self))  # every field is a scalar: asdict()'s deep copy would copy nothing more
        d["estimated_cost"] = str(self.estimated_cost)
        return d


def _ceil(x: Decimal) -> int:
    return int(x.to_integral_value(rounding=ROUND_CEILING))


def check_capabilities(req: GenerationRequest, config: PlatformConfig) -> None:
    """The capability matrix: some provider must offer the model at that duration and resolution."""
    offering = [p for p in config.providers if req.model in p.models]
    if not offering:
        raise InvalidRequest(f"unknown model {req.model!r}", {"body.model": f"unknown model; known: {', '.join(config.models)}"})
    max_duration = max(p.max_duration_seconds for p in offering)
    if req.duration_seconds > max_duration:
        raise InvalidRequest("duration not supported", {"body.duration_seconds": f"{req.model} supports at most {max_duration} s"})
    best = max(RESOLUTIONS.index(p.max_resolution) for p in offering)
    if RESOLUTIONS.index(req.resolution) > best:
        raise InvalidRequest("resolution not supported", {"body.resolution": f"{req.model} supports at most {RESOLUTIONS[best]}"})
    if len(req.inputs) > config.limits.max_inputs:
        raise InvalidRequest("too many inputs", {"body.inputs": f"at most {config.limits.max_inputs} inputs"})
    need = INPUT_KIND_BY_MODE.get(req.mode)
    # A mode that takes no inputs (text_to_video) refuses them rather than ignoring them: the server
    # never fetches media it would not use (each fetch is a request to a URL the client chose), and
    # the task never stores inputs its provider would be sent but the estimate did not measure.
    if need is None and req.inputs:
        raise InvalidRequest(f"{req.mode} takes no inputs", {"body.inputs": f"{req.mode} takes no inputs; send none"})
    if need and not any(i.kind == need for i in req.inputs):
        raise InvalidRequest(f"{req.mode} needs an input", {"body.inputs": f"{req.mode} needs at least one {need} input"})


def estimate(req: GenerationRequest, probed: list[ProbedMedia], service_class: str, config: PlatformConfig) -> Estimate:
    check_capabilities(req, config)
    res_f, mode_f = RESOLUTION_FACTOR[req.resolution], MODE_FACTOR[req.mode]
    audio_f = AUDIO_FACTOR if req.with_audio else Decimal(1)
    # Reference video lengthens the work: the provider has to read it (measured, never declared).
    input_seconds = sum(m.duration_seconds or 0.0 for m in probed if m.kind == "video")
    effective_seconds = Decimal(req.duration_seconds) + Decimal(str(round(input_seconds, 3))) / 2
    provider_seconds = PROVIDER_SECONDS_PER_OUTPUT_SECOND * effective_seconds * res_f * mode_f * audio_f
    cheapest = min(Decimal(p.cost_per_second) for p in config.providers if req.model in p.models)
    currency = next(p.currency for p in config.providers if req.model in p.models)
    cost = (cheapest * effective_seconds * res_f * mode_f * audio_f).quantize(Decimal("0.00000001"))
    gpu_units = GPU_UNITS[req.resolution]
    gpu_seconds = Decimal(gpu_units) * effective_seconds * 3
    fairness = max(1, _ceil(max(provider_seconds / PROVIDER_SECOND_BASE, cost / COST_BASE, gpu_seconds / GPU_SECOND_BASE)))
    expensive = req.resolution == "4k" or req.duration_seconds > EXPENSIVE_DURATION_SECONDS or req.mode == "video_to_video"
    if req.mode == "video_to_video":
        resource_class = "video-v2v"
    elif req.resolution == "4k":
        resource_class = "video-4k"
    else:
        resource_class = "video-standard"
    return Estimate(
        model=req.model, mode=req.mode, duration_seconds=req.duration_seconds, resolution=req.resolution,
        with_audio=req.with_audio, interactive=req.interactive, input_seconds=round(input_seconds, 3),
        fairness_units=fairness, provider_slot_units=1, gpu_units=gpu_units, media_units=MEDIA_UNITS[req.resolution],
        estimated_cost=cost, cost_currency=currency, estimated_cost_units=max(1, _ceil(cost * 100)),
        resource_class=resource_class, queue_class="EXPENSIVE" if expensive else service_class,
        priority_band=PRIORITY_BAND[(service_class, req.interactive)], is_expensive=expensive,
    )


def units_to_wait_seconds(units: float, mu_units_per_second: float) -> float:
    return math.inf if mu_units_per_second <= 0 else units / mu_units_per_second
