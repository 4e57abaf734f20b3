"""What Storage needs to know about S3 (s3fs): option defaults, multipart requests, error hints.

Retries: botocore retries on its own (5 attempts in its legacy mode) and s3fs wraps every
request in a second loop (`S3FileSystem.retries`, 5 attempts). Left on, one storage call
could make 25 attempts with backoff before our policy even sees an error, and no time budget
would hold. Both are set to a single attempt here, so `RetryPolicy` is the only retry loop;
a user who passes `config_kwargs={"retries": ...}` explicitly keeps botocore's. One
re-send remains below us: aiohttp repeats an idempotent request (GET, HEAD, PUT, DELETE) once
when a kept-alive connection turns out to be dead (RFC 9112 section 9.3.1), which costs at
most one more attempt's time.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

__all__ = ["PROTOCOLS", "S3Backend", "S3Sink", "explain", "prepare_options", "tune_filesystem"]

PROTOCOLS = frozenset({"s3", "s3a"})
# Option names that hold secrets: their values are redacted from every message we produce.
SECRET_OPTIONS = frozenset(
    {
        "key",
        "secret",
        "token",
        "password",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
    }
)


def prepare_options(options: dict[str, Any]) -> dict[str, Any]:
    """s3fs options with our defaults filled in (explicit user values win)."""
    opts = copy.deepcopy(options)
    # A private instance: we change its retry count, and a cached one may be the user's.
    opts.setdefault("skip_instance_cache", True)
    # Listings are read by other ranks and processes while we write: never trust a cache.
    opts.setdefault("use_listings_cache", False)
    config = dict(opts.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    opts["config_kwargs"] = config
    return opts


def tune_filesystem(fs: Any) -> None:
    """One attempt per request inside s3fs (see the module docstring)."""
    fs.retries = 1


def secrets_of(options: dict[str, Any]) -> list[str]:
    """Secret values named in `options`, nested dicts (client_kwargs, ...) included."""
    found: list[str] = []
    for k, v in options.items():
        if isinstance(v, dict):
            found += secrets_of(v)
        elif k in SECRET_OPTIONS and isinstance(v, str) and v:
            found.append(v)
    return found


class S3Sink:
    """The requests of one upload to s3://bucket/key, each through `call` (the retry policy)."""

    multipart = True

    def __init__(self, fs: Any, path: str, label: str, call: Any) -> None:
        self._fs = fs
        self._bucket, self._key, _ = fs.split_path(path)
        self._call = call
        self._where = label

    def put(self, data: bytes) -> None:
        self._call(
            f"put {self._where}",
            lambda: self._fs.call_s3("put_object", Bucket=self._bucket, Key=self._key, Body=data),
        )

    def start(self) -> str:
        out = self._call(
            f"start upload {self._where}",
            lambda: self._fs.call_s3("create_multipart_upload", Bucket=self._bucket, Key=self._key),
        )
        return str(out["UploadId"])

    def part(self, upload_id: str, number: int, data: bytes | bytearray) -> dict[str, Any]:
        out = self._call(
            f"upload part {number} of {self._where}",
            lambda: self._fs.call_s3(
                "upload_part",
                Bucket=self._bucket,
                Key=self._key,
                UploadId=upload_id,
                PartNumber=number,
                Body=data,
            ),
        )
        # botocore >= 1.36 adds a CRC32 to every part by default; an upload created with one
        # must list it again on completion, or AWS refuses to complete it.
        part = {"PartNumber": number, "ETag": out["ETag"]}
        part.update(
            {k: v for k, v in out.items() if k.startswith("Checksum") and k != "ChecksumType"}
        )
        return part

    def complete(self, upload_id: str, parts: list[dict[str, Any]]) -> None:
        ordered = sorted(parts, key=lambda p: int(p["PartNumber"]))
        tried = False

        def run() -> None:
            nonlocal tried
            try:
                self._fs.call_s3(
                    "complete_multipart_upload",
                    Bucket=self._bucket,
                    Key=self._key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": ordered},
                )
            except FileNotFoundError as e:
                # An earlier attempt completed it and its reply was lost: the upload is gone
                # and the object is there, with the ETag S3 gives these exact parts.
                if not (tried and error_code(e)[0] == "NoSuchUpload" and self._has(ordered)):
                    raise
            finally:
                tried = True

        self._call(f"complete upload {self._where}", run)

    def _has(self, parts: list[dict[str, Any]]) -> bool:
        digest = hashlib.md5(usedforsecurity=False)
        for p in parts:
            digest.update(bytes.fromhex(str(p["ETag"]).strip('"')))
        want = f'"{digest.hexdigest()}-{len(parts)}"'
        try:
            head = self._fs.call_s3("head_object", Bucket=self._bucket, Key=self._key)
        except FileNotFoundError:
            return False
        return bool(head.get("ETag") == want)

    def abort(self, upload_id: str) -> None:
        self._call(
            f"abort upload {self._where}",
            lambda: self._fs.call_s3(
                "abort_multipart_upload", Bucket=self._bucket, Key=self._key, UploadId=upload_id
            ),
            cleanup=True,
        )


def error_code(exc: BaseException) -> tuple[str | None, int | None]:
    """(S3 error code, HTTP status) of a botocore ClientError found in `exc`'s chain."""
    for e in _chain(exc):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and "Error" in response:
            code = response.get("Error", {}).get("Code")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return (str(code) if code else None), (int(status) if status else None)
    return None, None


def is_connection_error(exc: BaseException) -> bool:
    """botocore's connection-level errors: refused, reset, closed, timed out."""
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError
    except ImportError:  # pragma: no cover - s3fs depends on botocore
        return False
    kinds = (HTTPClientError, BotoConnectionError)
    return any(isinstance(e, kinds) for e in _chain(exc))


_CREDENTIAL_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "TokenRefreshRequired",
    "InvalidClientTokenId",
    "AuthorizationHeaderMalformed",
}


def explain(exc: BaseException, url: str, endpoint: str | None) -> str | None:
    """What went wrong with s3 location `url` and how to fix it; None when we cannot tell."""
    code, status = error_code(exc)
    bucket = url.split("://", 1)[-1].split("/", 1)[0]
    where = f" at {endpoint}" if endpoint else ""
    if code == "NoSuchBucket":
        return (
            f"Bucket {bucket!r} does not exist{where}. Create it (aws s3 mb s3://{bucket}) or fix "
            "the bucket name in the checkpoint URL; resilient never creates buckets."
        )
    if code in _CREDENTIAL_CODES:
        return (
            f"The S3 credentials were refused ({code}){where}. Check AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN, AWS_PROFILE and ~/.aws/credentials, "
            "or key/secret/token in storage_options."
        )
    if code in {"AccessDenied", "AllAccessDisabled", "AccountProblem"} or status == 403:
        return (
            f"Access to {url} was denied ({code or status}). The credentials need "
            "s3:PutObject, s3:GetObject, s3:ListBucket and s3:DeleteObject on the bucket and "
            "prefix."
        )
    if code in {"PermanentRedirect", "IllegalLocationConstraintException"} or status == 301:
        return (
            f"bucket {bucket!r} is in another region. Set AWS_REGION/AWS_DEFAULT_REGION or "
            "client_kwargs={'region_name': ...} in storage_options."
        )
    names = {type(e).__name__: e for e in _chain(exc)}
    if "NoCredentialsError" in names:
        return (
            "No AWS credentials were found (looked in AWS_* variables, AWS_PROFILE, "
            "~/.aws/credentials and ~/.aws/config). Set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (plus AWS_SESSION_TOKEN for temporary ones), or AWS_PROFILE, "
            "or key/secret in storage_options."
        )
    if "PartialCredentialsError" in names:
        return (
            f"The AWS credentials are incomplete ({names['PartialCredentialsError']}). Set both "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or key and secret in "
            "storage_options."
        )
    if "ProfileNotFound" in names:
        return (
            f"{names['ProfileNotFound']} in ~/.aws/config or ~/.aws/credentials (or "
            "AWS_CONFIG_FILE/AWS_SHARED_CREDENTIALS_FILE). Fix AWS_PROFILE, or add the profile "
            "(aws configure --profile NAME)."
        )
    if "CredentialRetrievalError" in names:
        return (
            "The AWS credentials could not be fetched from their provider (a credential_process, "
            "SSO or role). Check AWS_PROFILE and its settings in ~/.aws/config, or set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY."
        )
    if "ParamValidationError" in names and "bucket name" in str(names["ParamValidationError"]):
        return (
            f"{bucket!r} is not a valid S3 bucket name. Write the location as s3://BUCKET/PREFIX, "
            "with credentials in AWS_* variables, AWS_PROFILE or storage_options, never in the "
            "URL."
        )
    if is_connection_error(exc):
        return (
            f"Cannot reach the S3 endpoint{where or ''}. Check AWS_ENDPOINT_URL (or "
            "endpoint_url in storage_options) and that the service is up and reachable."
        )
    return None


def endpoint_of(fs: Any) -> str | None:
    """The endpoint URL the filesystem talks to, when it has connected already."""
    client = getattr(fs, "_s3", None)
    meta = getattr(client, "meta", None)
    return getattr(meta, "endpoint_url", None) or getattr(fs, "endpoint_url", None)


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in out and len(out) < 16:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


class S3Backend:
    """resilient.storage.backends.Backend for s3:// through s3fs."""

    def prepare_options(self, options: dict[str, Any]) -> dict[str, Any]:
        return prepare_options(options)

    def tune(self, fs: Any) -> None:
        tune_filesystem(fs)

    def secrets(self, options: dict[str, Any]) -> list[str]:
        return secrets_of(options)

    def is_file(self, storage: Any, path: str) -> bool:
        """One HEAD (s3fs's isfile may list the prefix too)."""
        bucket, key, _ = storage.fs.split_path(path)
        try:
            storage.fs.call_s3("head_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return False
        return True

    def copy(self, storage: Any, src: str, dst: str) -> None:
        """One CopyObject (s3fs's cp_file asks for the size first): files up to 5 GB."""
        bucket, key, _ = storage.fs.split_path(src)
        dbucket, dkey, _ = storage.fs.split_path(dst)
        source = {"Bucket": bucket, "Key": key}
        storage.fs.call_s3("copy_object", Bucket=dbucket, Key=dkey, CopySource=source)

    def sink(self, storage: Any, rel: str) -> S3Sink:
        return S3Sink(storage.fs, storage.path(rel), rel, storage.call)

    def explain(self, storage: Any, exc: BaseException) -> str | None:
        return explain(exc, storage.url, endpoint_of(storage.fs))
