"""`train.storage`: where checkpoints go, and the URIs refused because they carry credentials."""

from __future__ import annotations


STORAGE_SCHEMES = ("file", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")
"""URI schemes train.storage takes: those pyarrow.fs opens."""


def storage_problem(value: str) -> str | None:
    """Why `value` is not a usable train.storage, or None."""
    if not value.strip():
        return "train.storage: empty; leave it out (checkpoints in the run directory) or give a URI"
    scheme, sep, rest = value.partition("://")
    if not sep:
        return None  # a path (on a shared filesystem), resolved against the config file
    problem = credentials_problem(value, "train.storage")
    if problem:
        return problem
    if scheme not in STORAGE_SCHEMES:
        return (f"train.storage: scheme {scheme!r} of {value!r} is not supported; give one of "
                f"{', '.join(s + '://' for s in STORAGE_SCHEMES)}, or a path on a shared filesystem")
    if scheme == "file" and not rest.startswith("/"):
        return f"train.storage: {value!r} is not an absolute file URI; write file:///absolute/path"
    if scheme != "file" and not rest.strip("/"):
        return f"train.storage: {value!r} names no bucket or host; write {scheme}://bucket/prefix"
    return None


_SECRET_WORDS = ("key", "secret", "token", "password", "sas", "credential")
"""A URI's query option whose name holds one of these carries a credential (pyarrow's access_key, secret_key,
session_token for S3; account_key, sas_token, client_secret for Azure)."""


def credentials_problem(uri: str, what: str) -> str | None:
    """Why the storage URI `uri` (given as `what`) must be refused: it carries credentials (a password before the
    host, S3's `KEY:SECRET@`, a secret query option), which would be written to config.yaml, store.json, the store
    and reports; None when it carries none. The message shows the URI with them hidden."""
    import re
    from urllib.parse import parse_qsl, urlsplit

    try:
        parts = urlsplit(uri)
    except ValueError:
        return None
    userinfo = parts.netloc.rpartition("@")[0] if "@" in parts.netloc else ""
    secret_options = [k for k, _ in parse_qsl(parts.query, keep_blank_values=True)
                      if any(word in k.lower() for word in _SECRET_WORDS)]
    if not (":" in userinfo or (userinfo and parts.scheme == "s3") or secret_options):
        return None
    shown = uri.replace(f"{userinfo}@", "***@") if userinfo else uri
    for option in secret_options:
        shown = re.sub(rf"([?&]{re.escape(option)}=)[^&#]*", r"\1***", shown)
    return (f"{what}: {shown!r} holds credentials, which would be written to config.yaml, store.json, the store and "
            "reports; remove them and give them as the store's client takes them: environment variables such as "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (ray.forward_env passes them to every trainer), config files "
            "or instance roles")
