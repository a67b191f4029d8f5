"""Namespace -> team mapping, applied at report time.

File format (YAML; see ``deploy/teams.example.yaml``)::

    teams:                       # first matching rule wins
      - namespace: ml-train      # exact name or glob (* ? [..]), case-sensitive like Kubernetes names
        team: ml-platform
      - namespace: "research-*"
        team: research

A rule may match a pod label's value instead of the namespace (teams are often a label,
not a namespace); it applies where the records carry labels (the chargeback ``workloads`` breakdown,
idle recommendations), and is skipped where they do not::

      - label: team              # pod label key (the producer's --pod-labels must select it)
        value: "ml-*"            # exact value or glob
        team: ml-platform

A namespace no rule matches is its own team. The pseudo-namespaces (``__unallocated__``,
``__mig_shared__``) are never mapped: they are capacity and energy no team held, and a catch-all
``"*"`` rule must not hide them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from gpupipe.common.errors import ConfigError
from gpupipe.common.yaml_file import load_yaml


class TeamMapError(ConfigError):
    """The namespace-to-team mapping file is missing or malformed; the message names the entry."""


def _pseudo(namespace: str) -> bool:
    """A pipeline pseudo-namespace (``__unallocated__`` and its kin, gpupipe_schemas.meaning): never a team's.
    Kubernetes namespace names are DNS labels and cannot hold ``_``, so the form alone decides."""
    return namespace.startswith("__") and namespace.endswith("__")


_RULE_KEYS = frozenset({"namespace", "team"})
_LABEL_RULE_KEYS = frozenset({"label", "value", "team"})


@dataclass(frozen=True)
class TeamMap:
    rules: tuple[tuple[str, str], ...] = ()  # (namespace glob, team) in file order
    _cache: dict[str, str | None] = field(default_factory=dict, repr=False, compare=False)
    # Every rule in file order: (label key or None for a namespace rule, glob, team).
    ordered: tuple[tuple[str | None, str, str], ...] = ()

    @property
    def has_label_rules(self) -> bool:
        return any(key is not None for key, _, _ in self.ordered)

    def match(self, namespace: str, labels: Mapping[str, str] | None = None) -> str | None:
        """Team of the first rule matching ``namespace`` (or, for a label rule, ``labels``); None when none
        does (or for a pseudo-namespace)."""
        if not labels or not self.has_label_rules:
            return self._match_namespace(namespace)
        if _pseudo(namespace):
            return None
        for key, pattern, team in self.ordered or tuple((None, p, t) for p, t in self.rules):
            value = namespace if key is None else labels.get(key)
            if value is not None and fnmatchcase(value, pattern):
                return team
        return None

    def _match_namespace(self, namespace: str) -> str | None:
        if namespace in self._cache:
            return self._cache[namespace]
        hit = None
        if not _pseudo(namespace):
            for key, pattern, team in self.ordered or tuple((None, p, t) for p, t in self.rules):
                if key is None and fnmatchcase(namespace, pattern):
                    hit = team
                    break
        self._cache[namespace] = hit
        return hit

    def team_of(self, namespace: str) -> str:
        """The team of ``namespace``: first matching rule, else the namespace itself."""
        return self.match(namespace) or namespace

    __call__ = team_of


def parse_team_map(data: Any, source: str = "<teams>") -> TeamMap:
    if data is None:
        return TeamMap()
    if not isinstance(data, dict) or set(data) != {"teams"}:
        raise TeamMapError(f"{source}: expected a mapping with one key, teams")
    rules = data["teams"] or []
    if not isinstance(rules, list):
        raise TeamMapError(f"{source}: teams must be a list of {{namespace, team}} rules")
    out = []
    ordered: list[tuple[str | None, str, str]] = []
    for i, rule in enumerate(rules):
        where = f"{source}: teams[{i}]"
        if isinstance(rule, dict) and set(rule) == _LABEL_RULE_KEYS:
            key, value, team = rule["label"], rule["value"], rule["team"]
            if not all(isinstance(v, str) and v for v in (key, value, team)):
                raise TeamMapError(f"{where}: label, value and team must be non-empty strings")
            ordered.append((key, value, team))
            continue
        if not isinstance(rule, dict) or set(rule) != _RULE_KEYS:
            raise TeamMapError(
                f"{where}: expected the keys namespace and team (or label, value and team), got {rule!r}"
            )
        ns, team = rule["namespace"], rule["team"]
        if not isinstance(ns, str) or not ns or not isinstance(team, str) or not team:
            raise TeamMapError(f"{where}: namespace and team must be non-empty strings")
        out.append((ns, team))
        ordered.append((None, ns, team))
    return TeamMap(tuple(out), ordered=tuple(ordered))


def load_team_map(path: str | Path) -> TeamMap:
    return parse_team_map(load_yaml(path, "team mapping", TeamMapError), str(path))
