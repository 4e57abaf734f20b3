"""Credentials never shown: redaction of messages and URLs before they reach a log or error."""

from __future__ import annotations

import os
import re

__all__ = ["hide_userinfo", "redact", "userinfo_secrets"]


def redact(text: str, extra: tuple[str, ...] = ()) -> str:
    """Drop anything that looks like a credential from a message before it is shown."""
    secrets = [os.environ.get(k, "") for k in _SECRET_ENV] + list(extra)
    for val in sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True):
        text = text.replace(val, "***")
    return text


_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")
# user:password@ (a password pasted unencoded may hold "/"), or user@
_USERINFO = re.compile(r"^([a-zA-Z][\w+.-]*://)([^/@:]*:[^@]*|[^/@]*)@")


def hide_userinfo(url: str) -> str:
    """`url` without the user:password@ part it may carry."""
    return _USERINFO.sub(r"\1***@", url)


def userinfo_secrets(url: str) -> list[str]:
    """The user:password@ part of `url` and its pieces: errors of the layers below quote the
    URL as given, or the part of it before a "/" (a bucket name), so each is redacted like
    any credential."""
    found = _USERINFO.match(url)
    if not found or not found.group(2):
        return []
    info = found.group(2)
    pieces = [info, *info.split(":", 1)]
    return pieces + [part for piece in pieces for part in piece.split("/")]
