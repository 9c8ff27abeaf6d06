"""docs/deploy.md says what an operator needs: the files it cites exist, the tools it uses
are listed, and a `secrets.sh --dir` folder's way into a cluster (the TLS Secret's type)."""

from __future__ import annotations

import re

from tests.helpers import REPO

DOC = (REPO / "docs" / "deploy.md").read_text()


def test_cited_paths_exist() -> None:
    cited = set(re.findall(r"`((?:tests|deploy|prefixgate|docs|scripts)/[\w./-]+?)`", DOC))
    missing = sorted(p for p in cited if not (REPO / p.rstrip("/")).exists())
    assert cited and not missing, missing


def test_tools_and_secret_loading_are_spelled_out() -> None:
    if "kustomize edit" in DOC:
        assert "standalone" in DOC and "kubectl.docs.kubernetes.io/installation/kustomize" in DOC
    assert "secrets.sh -n NAMESPACE --dir DIR" in DOC
    assert "create secret generic prefixgate-tls --type=kubernetes.io/tls" in DOC
