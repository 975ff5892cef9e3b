"""The signature of a thinking block (and a reasoning item's ``encrypted_content``): the reasoning, carried back.

Clients send earlier reasoning back in a tool loop, as the APIs require; some
send it without its text (Anthropic's ``display: "omitted"``, Codex's
reasoning items with ``store: false`` and only ``encrypted_content``). The
chat template may render that reasoning into the next prompt (Qwen3's
templates do in the current tool loop), and if it is missing the prompt
stops matching the agent's cache where the reasoning was. So the signature
carries the text itself: ``semantic.r1.`` + base64url of the zlib-compressed
UTF-8 + ``.`` + a BLAKE2b check of the text. Nothing is kept on the server,
so it also works after a restart or on another agent.

It is not a secret and claims no authenticity: a client could write any
reasoning into its request anyway. The check only tells this server's
signatures from others' (a real Anthropic signature, a truncated copy);
one that does not verify is used as given: its block's own text, never an
error.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import zlib

PREFIX = "semantic.r1."


def _check(text: bytes) -> str:
    return hashlib.blake2b(text, digest_size=8).hexdigest()


def sign(reasoning: str) -> str:
    raw = reasoning.encode("utf-8", "surrogatepass")
    body = base64.urlsafe_b64encode(zlib.compress(raw, 6)).decode("ascii").rstrip("=")
    return f"{PREFIX}{body}.{_check(raw)}"


def reasoning_of(signature: object) -> str | None:
    """The reasoning a signature carries; None when it is not one of this server's, or does not verify."""
    if not isinstance(signature, str) or not signature.startswith(PREFIX):
        return None
    body, _, check = signature[len(PREFIX):].rpartition(".")
    try:
        raw = zlib.decompress(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    except (binascii.Error, ValueError, zlib.error):
        return None
    if _check(raw) != check:
        return None
    try:
        return raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None


def restored(text: str, signature: object) -> str:
    """A block's reasoning: what its signature carries when it verifies (exactly what the model wrote, whatever the
    client did to the text: the APIs forbid changing it), else the block's own text."""
    carried = reasoning_of(signature)
    return carried if carried is not None else text
