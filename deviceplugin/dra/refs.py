"""What the DRA driver accepts as a claim's namespace, name and UID (pure).

A claim reference comes from the kubelet's gRPC call (or anyone who can reach the driver's
socket), from the API server, or from the checkpoint; its namespace and name go into the API
server's URL and its UID into a file name and a CDI device name. Each is checked before it is
used: a namespace is a DNS-1123 label, a name a DNS-1123 subdomain (what the API server itself
allows), and a UID 1 to 64 letters, digits, `-`, `_` or `.` starting and ending with a letter or
digit (the API server's UIDs are UUIDs). None of them then needs escaping anywhere. Refusals name
the field and show its value escaped (`ascii`), cut to 80 characters: nothing from outside
forges a log line.
"""

from __future__ import annotations

import re

MAX_LABEL = 63
MAX_SUBDOMAIN = 253
MAX_UID = 64

_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_UID = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?")


def shown(value: object) -> str:
    """`value` for a message: escaped (quoted, as `ascii` writes it), at most 80 characters."""
    return _cut(ascii(value))


def escaped(text: str) -> str:
    """`text` for a message: escaped as `ascii` does, without quotes, at most 80 characters."""
    return _cut(ascii(text)[1:-1])


def _cut(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."


def is_dns_label(value: object) -> bool:
    return (
        isinstance(value, str) and len(value) <= MAX_LABEL and _LABEL.fullmatch(value) is not None
    )


def is_dns_subdomain(value: object) -> bool:
    return (
        isinstance(value, str)
        and 0 < len(value) <= MAX_SUBDOMAIN
        and all(is_dns_label(part) for part in value.split("."))
    )


def is_claim_uid(value: object) -> bool:
    return isinstance(value, str) and len(value) <= MAX_UID and _UID.fullmatch(value) is not None


def namespace_problem(namespace: object) -> str:
    if is_dns_label(namespace):
        return ""
    return (
        f"namespace {shown(namespace)} is not a DNS-1123 label (lowercase letters, digits and "
        f"'-', at most {MAX_LABEL} characters)"
    )


def name_problem(name: object) -> str:
    if is_dns_subdomain(name):
        return ""
    return (
        f"name {shown(name)} is not a DNS-1123 subdomain (lowercase letters, digits, '-' and "
        f"'.', at most {MAX_SUBDOMAIN} characters)"
    )


def uid_problem(uid: object) -> str:
    if is_claim_uid(uid):
        return ""
    return (
        f"uid {shown(uid)} is not a claim UID (letters, digits, '-', '_' and '.', at most "
        f"{MAX_UID} characters)"
    )


def ref_problem(namespace: object, name: object, uid: object) -> str:
    """Why a claim reference is refused; "" when it is valid."""
    problems = [
        p for p in (uid_problem(uid), namespace_problem(namespace), name_problem(name)) if p
    ]
    if not problems:
        return ""
    return "claim reference refused: " + "; ".join(problems)
