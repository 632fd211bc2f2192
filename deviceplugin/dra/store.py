"""The prepared claims, checkpointed in the state directory (`dra-claims.json`).

Written before Prepare answers and after Unprepare has removed the CDI spec, so that a daemon
killed at any point finds, at its next start, every claim the kubelet believes prepared: Prepare
of a claim already here returns what it returned before, and Unprepare of one no longer here
succeeds (both are idempotent, as the kubelet retries either).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

from deviceplugin.dra import files
from deviceplugin.dra.claims import PreparedClaim, claims_from_json, claims_to_json

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "dra-claims.json"
VERSION = 1


class ClaimStore:
    """The prepared claims by UID, mirrored to the checkpoint on every change."""

    def __init__(self, state_dir: Path) -> None:
        self._dir = state_dir
        self._claims: dict[str, PreparedClaim] = {}

    def load(self) -> None:
        """Read the checkpoint. A malformed one is an error naming the file: the daemon must not
        forget claims the kubelet holds prepared (move the file away to start empty)."""
        raw = files.read_file(self._dir, CHECKPOINT_FILE)
        if raw is None:
            return
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("version") != VERSION:
                raise ValueError(f"expected an object with version {VERSION}")
            claims = claims_from_json(doc.get("claims"))
        except ValueError as e:
            raise ValueError(
                f"the DRA checkpoint {self._dir / CHECKPOINT_FILE} is unreadable: {e}; move it "
                "away to start with no prepared claim"
            ) from None
        self._claims = {c.uid: c for c in claims}
        log.info("prepared claims recovered from the checkpoint claims=%d", len(self._claims))

    def _save(self) -> None:
        doc = {"version": VERSION, "claims": claims_to_json(list(self._claims.values()))}
        files.write_file(self._dir, CHECKPOINT_FILE, json.dumps(doc, sort_keys=True).encode())

    def get(self, uid: str) -> PreparedClaim | None:
        return self._claims.get(uid)

    def put(self, claim: PreparedClaim) -> None:
        self._claims[claim.uid] = claim
        self._save()

    def remove(self, uid: str) -> bool:
        if self._claims.pop(uid, None) is None:
            return False
        self._save()
        return True

    def __iter__(self) -> Iterator[PreparedClaim]:
        return iter(list(self._claims.values()))

    def __len__(self) -> int:
        return len(self._claims)
