"""Safe, collision-free file names for agent ids.

Agent ids come from clients and may be anything: ``../x``, ``/etc/passwd``,
NUL bytes, emoji, right-to-left text, megabytes of text. A file stem is a
readable ASCII slug of the id (for people browsing the cache directory) plus a
hash of the whole id (for uniqueness). The full id is stored inside the file,
so the mapping never needs to be inverted.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

SLUG_MAX_CHARS = 40
MODEL_SLUG_MAX_CHARS = 40
MODEL_DIGEST_CHARS = 16
# Shared prefix files are cache files of a pseudo-agent with this id prefix.
AGENT_PREFIX = "prefix-"
DIGEST_HEX_CHARS = 20  # 80 bits: a collision needs ~2**40 agents
STEM_MAX_CHARS = SLUG_MAX_CHARS + 1 + DIGEST_HEX_CHARS

_UNSAFE_RUN = re.compile(r"[^A-Za-z0-9_-]+")


def agent_file_stem(agent_id: str) -> str:
    """``{slug}-{digest}``, or just ``{digest}`` when the id has no ASCII letters or digits.

    The digest is lowercase hex, so two ids differing only in letter case
    still get names that differ on case-insensitive file systems (APFS).
    """
    slug = readable_slug(agent_id)
    digest = id_digest(agent_id)
    return f"{slug}-{digest}" if slug else digest


def id_digest(agent_id: str) -> str:
    # surrogatepass: ids decoded from JSON may hold lone surrogates, which
    # plain UTF-8 refuses to encode; they still deserve a distinct name.
    data = agent_id.encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()[:DIGEST_HEX_CHARS]


def readable_slug(agent_id: str) -> str:
    """ASCII letters, digits, ``-`` and ``_`` of the id, accents folded ("café" -> "cafe")."""
    folded = unicodedata.normalize("NFKD", agent_id[: SLUG_MAX_CHARS * 4])
    ascii_only = folded.encode("ascii", "ignore").decode("ascii")
    # A leading "-" would read as an option to shell tools; a trailing one
    # would run into the digest separator.
    slug = _UNSAFE_RUN.sub("-", ascii_only).strip("-")
    return slug[:SLUG_MAX_CHARS].rstrip("-")


def model_dir_name(model_name: str, model_digest: str) -> str:
    """The warm tier's folder for one model: a readable slug of its name and its digest.

    Lives here, not in ``warm_store``, so tools that read the cache directory
    without loading a model (agent export, ``semantic agents``) name it alike.
    """
    slug = "".join(c if c.isalnum() or c in "-_." else "-" for c in model_name)[:MODEL_SLUG_MAX_CHARS]
    return f"{slug}-{model_digest[:MODEL_DIGEST_CHARS]}"
