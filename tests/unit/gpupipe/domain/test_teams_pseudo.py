"""The team map never gives a pseudo-namespace a team, knowing them by their form alone."""

from __future__ import annotations

from gpupipe.domain.teams import parse_team_map
from gpupipe_schemas.meaning import PSEUDO_NAMESPACES


def test_every_pseudo_namespace_is_known_by_its_form() -> None:
    teams = parse_team_map({"teams": [{"namespace": "*", "team": "everyone"}]})
    assert teams.match("ml-train") == "everyone"
    for ns in PSEUDO_NAMESPACES:
        assert teams.match(ns) is None, ns
        assert teams.match(ns, {"team": "x"}) is None, ns
