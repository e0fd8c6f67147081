"""`msc://profile/path`: the S3 store a multi-storage-client profile names, found by MSC's
own loader (`MSC_CONFIG`, `~/.msc_config.yaml`, ..., and its credentials providers), so a
megatron job's paths carry over; `objstore` serves the objects exactly as for `s3://`."""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, Optional, Tuple

from ..errors import CheckpointingException

__all__ = ["Profile", "profile"]

# s8k is S3 retrying 429s (standard retries do too); ais_s3 (JWT), gcs_s3 (no bulk delete)
# and s3_cuobject (RDMA) change the protocol itself
SERVED = ("s3", "s8k")
_SETTINGS = ("endpoint_url", "region_name", "verify", "profile_name", "s3")
Profile = Tuple[str, str, Dict[str, Any]]  # bucket, key prefix, settings of the boto3 client
_profiles: Dict[Tuple[Optional[str], str], Profile] = {}
_lock = threading.Lock()


def profile(name: str, url: str = "") -> Profile:
    """The store of MSC profile `name` (read once per `MSC_CONFIG`); `CheckpointingException`
    naming `url` if multi-storage-client is missing or the profile cannot be served."""
    with _lock:
        key = (os.environ.get("MSC_CONFIG"), name)
        if key not in _profiles:
            _profiles[key] = _resolve(name, url or f"msc://{name}")
        return _profiles[key]


def _resolve(name: str, url: str) -> Profile:
    try:
        from multistorageclient import StorageClientConfig
        from multistorageclient.utils import expand_env_vars
    except ImportError as e:
        hint = "pip install 'dist_checkpointing[msc]' (multi-storage-client)"
        raise CheckpointingException(f"{url}: msc:// paths need {hint}") from e
    try:
        config, found = StorageClientConfig.read_msc_config()
        spec = expand_env_vars((config or {}).get("profiles", {}).get(name) or {})
        provider = spec.get("storage_provider", {})
        kind, options = provider.get("type"), provider.get("options", {})
        # MSC builds the credentials provider the profile names, whichever kind it is
        made = StorageClientConfig.from_file(profile=name) if kind in SERVED else None
        creds = made and made.credentials_provider and made.credentials_provider.get_credentials()
    except Exception as e:
        raise CheckpointingException(f"{url}: MSC profile {name!r}: {e}") from e
    bucket, _, base = str(options.get("base_path", "")).strip("/").partition("/")
    if kind not in SERVED or not bucket:
        why = f"storage provider {kind!r} is not one of the S3-compatible {SERVED}"
        if not spec:
            why = f"not found in {found or 'any MSC config (MSC_CONFIG, ~/.msc_config.yaml)'}"
        elif kind in SERVED:
            why = "no bucket in its base_path"
        raise CheckpointingException(f"{url}: MSC profile {name!r}: {why}")
    settings = {k: options[k] for k in _SETTINGS if k in options}
    if creds:
        settings.update(aws_access_key_id=creds.access_key, aws_secret_access_key=creds.secret_key)
        settings.update(aws_session_token=creds.token)
    return bucket, base.strip("/"), settings
