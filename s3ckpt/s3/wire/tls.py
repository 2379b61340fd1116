"""The TLS settings of the transport's connections, and which endpoints it does not serve.

Verification is what aiobotocore does with the same ``verify`` value: certificate chain
and host name, a custom CA file, SNI. Endpoints reached through an HTTP proxy are left
to aiobotocore (the transport connects to the endpoint itself).
"""

from __future__ import annotations

import ssl
import urllib.request
from urllib.parse import urlsplit

from s3ckpt.s3.compat_botocore import ca_bundle, default_tls_context


def proxied(endpoint_url: str, proxies: dict[str, str] | None = None) -> bool:
    """Whether requests to ``endpoint_url`` go through a proxy: one configured for its
    scheme, or one the environment names (``HTTPS_PROXY``...) that ``NO_PROXY`` does not
    bypass."""
    parts = urlsplit(endpoint_url)
    if proxies and parts.scheme in proxies:
        return True
    if parts.scheme not in urllib.request.getproxies():
        return False
    return not urllib.request.proxy_bypass(parts.hostname or "")


def tls_context(verify: bool | str) -> ssl.SSLContext:
    """The TLS settings aiobotocore derives from the same ``verify`` value."""
    context = default_tls_context()
    if verify:
        context.verify_mode = ssl.CERT_REQUIRED
        context.check_hostname = True
        ca_certs = ca_bundle(verify)
        if ca_certs:
            context.load_verify_locations(ca_certs, None, None)
    else:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
