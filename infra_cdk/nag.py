"""cdk-nag (AwsSolutions) suppressions, each with its reason next to the resource it excuses.

`suppress(construct, ("AwsSolutions-XXX", "why", [applies_to...]), ...)` wraps
NagSuppressions.add_resource_suppressions; applies_to narrows a suppression to the findings it
names (a string such as "Resource::*", or a cdk_nag.RegexAppliesTo). The infra tests read every
suppression back from the templates, require a reason of substance, and fail on one that no
longer excuses anything."""
from __future__ import annotations

from collections.abc import Sequence

from cdk_nag import NagPackSuppression, NagSuppressions
from constructs import IConstruct

Suppression = tuple[str, str] | tuple[str, str, Sequence[object]]
MIN_REASON_CHARS = 40


def suppress(construct: IConstruct, *items: Suppression, children: bool = False) -> None:
    packs = []
    for item in items:
        rule, reason = item[0], item[1]
        applies_to = list(item[2]) if len(item) > 2 else None  # type: ignore[misc]
        if len(reason) < MIN_REASON_CHARS:
            raise ValueError(f"{rule} on {construct.node.path}: give a real reason, not {reason!r}")
        packs.append(NagPackSuppression(id=rule, reason=reason, applies_to=applies_to))
    NagSuppressions.add_resource_suppressions(construct, packs, apply_to_children=children)

