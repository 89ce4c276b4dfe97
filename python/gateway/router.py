"""Classification and routing (SPEC §4): priority, complexity, alias → pool.

Every decision carries the rule that made it; the rule is returned in response headers and
logs so an operator can always answer "why did this request go there?".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from multidict import istr

from gateway._core import Priority
from gateway.classify import ComplexityClassifier, header_value
from gateway.config import PRIORITIES, Config
from gateway.errors import InvalidRequest, ModelNotFound

__all__ = ["Decision", "Router"]

# SPEC §4: body `service_tier` (`priority` → high, `flex` → low); other tiers say nothing.
_SERVICE_TIER = {"priority": Priority.HIGH, "flex": Priority.LOW}
# aiohttp's case-insensitive headers find an `istr` without folding its case first (~70 ns a
# look-up, per request); a plain dict (a batch line's) finds it as the str it is.
_X_PRIORITY = istr("X-Priority")
_X_COMPLEXITY = istr("X-Complexity")


@dataclass(slots=True)
class Decision:
    """Where one request goes and why. A value: never changed once made (another pool is a
    new one, `dataclasses.replace`). Not `frozen=True`, whose `__init__` sets each field
    through `object.__setattr__`: 0.58 against 0.16 µs, once per request (issue 25)."""

    pool: str
    priority: Priority
    priority_rule: str
    complexity: str
    complexity_rule: str

    @property
    def complexity_header(self) -> str:
        # Percent-encoded beyond printable ASCII: header values are latin-1 on the wire.
        return header_value(self.complexity, self.complexity_rule)


class Router:
    """Resolves a request to a pool, its priority and its complexity."""

    def __init__(self, config: Config, previous: Router | None = None) -> None:
        """`previous`: the router of the config before a reload, whose classifier is kept
        when `routing.classifier` and `routing.default_complexity` did not change (building
        one compiles its keyword automata: ~40 ms, most of a reload's CPU)."""
        self.config = config
        self.default_priority = PRIORITIES[config.default_priority]
        # The complexity a pool stands for, from `routing.complexity` (light → simple).
        self._pool_complexity: dict[str, str] = {}
        cx = config.routing.complexity
        if cx.simple:
            self._pool_complexity.setdefault(cx.simple, "simple")
        if cx.complex:
            self._pool_complexity.setdefault(cx.complex, "complex")
        r, before = config.routing, previous.config.routing if previous is not None else None
        if (
            previous is not None
            and before is not None
            and (r.classifier, r.default_complexity)
            == (before.classifier, before.default_complexity)
        ):
            classifier = previous.classifier  # immutable once built
        else:
            classifier = ComplexityClassifier.from_config(config)
        self.classifier: ComplexityClassifier = classifier
        #: SPEC §15: how much of a prompt an affinity key covers; 0 when no pool uses affinity
        #: (requests then carry no key and nothing is hashed).
        self.affinity_prefix_chars = config.affinity.prefix_chars if config.uses_affinity() else 0

    def aliases(self) -> list[str]:
        return sorted(self.config.models)

    def decide(
        self,
        alias: Any,
        headers: Mapping[str, str],
        body: Mapping[str, Any],
        key_priority: Priority | None = None,
    ) -> Decision:
        spec = self.config.models.get(alias) if isinstance(alias, str) else None
        if spec is None:
            raise ModelNotFound(
                f"The model {_quote(alias)} does not exist on this gateway; "
                f"GET /v1/models lists the served models.",
                param="model",
            )
        priority, priority_rule = self._priority(headers, body, key_priority)
        header_cx = headers.get(_X_COMPLEXITY)
        if header_cx is not None:
            complexity = header_cx.strip().lower()
            if complexity not in ("simple", "complex"):
                raise InvalidRequest(
                    "X-Complexity must be 'simple' or 'complex'",
                    param="X-Complexity",
                )
            rule = "header"
        elif spec.pool is not None:
            complexity = self._pool_complexity.get(spec.pool, "simple")
            rule = f"alias={alias}"
        else:
            # SPEC §4: "the classifier for auto aliases — explainable rules".
            complexity, rule = self.classifier.classify(body)
        if spec.pool is not None:
            pool = spec.pool
        else:
            cx = self.config.routing.complexity
            target = cx.complex if complexity == "complex" else cx.simple
            assert target is not None, "config validation guarantees auto routing targets"
            pool = target
        return Decision(pool, priority, priority_rule, complexity, rule)

    def _priority(
        self, headers: Mapping[str, str], body: Mapping[str, Any], key_priority: Priority | None
    ) -> tuple[Priority, str]:
        # SPEC §4: "Priority, first match wins: header X-Priority ...; body service_tier ...;
        # the API key's default priority; the configured default_priority".
        raw = headers.get(_X_PRIORITY)
        if raw is not None:
            p = PRIORITIES.get(raw.strip().lower())
            if p is None:
                raise InvalidRequest(
                    "X-Priority must be one of high, low, realtime, batch",
                    param="X-Priority",
                )
            return p, "header"
        tier = body.get("service_tier")
        if isinstance(tier, str) and tier in _SERVICE_TIER:
            return _SERVICE_TIER[tier], "service_tier"
        if key_priority is not None:
            return key_priority, "api_key"
        return self.default_priority, "default"


def _quote(value: Any) -> str:
    """The client's alias, quoted for an error message: bounded, control characters escaped."""
    text = value if isinstance(value, str) else repr(value)
    text = text[:100].encode("unicode_escape").decode("ascii")
    return f"'{text}'"
