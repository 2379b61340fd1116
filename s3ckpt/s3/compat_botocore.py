"""Everything s3ckpt needs from botocore beyond its public client API, in one place.

The internals s3ckpt relies on, each behind a function here:

* botocore's event hooks, registered on ``client.meta.events``:
  ``before-sign.s3.<Operation>``, whose handler may still change the request
  (``.body``, ``.headers``) before it is signed (:func:`on_before_sign`: the
  ``Content-MD5`` of DeleteObjects, :mod:`s3ckpt.s3.client`), and
  ``before-send.s3.<Operation>``, whose handler gets the signed request (``.method``,
  ``.url``, ``.headers``, ``.body``) and may answer it itself by returning a response
  (:func:`on_before_send`: upload bodies on the data plane, :mod:`s3ckpt.s3.wire.uploads`; the response
  it returns is aiobotocore's, :mod:`s3ckpt.s3.compat_aiobotocore`);
* botocore's SigV4 signer for S3 (``botocore.auth.S3SigV4Auth`` over an ``AWSRequest``,
  the client's config in its context, which says whether payloads are signed), and its
  response parser for the client's protocol (``botocore.parsers.create_parser``, the
  operation's output shape from the client's service model) with the client's modeled
  exception classes: part uploads built on the data plane are signed and their errors
  read exactly as the client would (:func:`sign_s3`, :func:`client_error`,
  :mod:`s3ckpt.s3.wire.uploads`);
* its request serializer for the client's protocol (``botocore.serialize.create_serializer``,
  the request dict's ``method``, ``url_path``, ``query_string``, ``headers``, ``body``,
  joined into a URL as ``botocore.awsrequest.prepare_request_dict`` joins them, with
  ``botocore.utils.percent_encode_sequence``) and the S3 handlers the client runs around
  the control requests the data plane sends: ``_handle_200_error`` (a ``200`` whose body is
  an error document), ``escape_xml_payload`` (DeleteObjects) and
  ``decode_list_object_v2`` (listings asked with ``EncodingType=url``)
  (:class:`SerializedRequest`, :func:`serialized`, :func:`answer_status`,
  :func:`escaped_xml`, :func:`decoded_listing`;
  :class:`s3ckpt.s3.wire.data_plane.SignedCalls`);
* ``botocore.httpsession``'s ``create_urllib3_context`` and ``get_cert_path``, from which
  botocore's HTTP session, and aiobotocore's, derive their TLS context and CA bundle
  (:func:`default_tls_context`, :func:`ca_bundle`: the ranged GETs and the TLS upload
  path verify as aiobotocore does, :mod:`s3ckpt.s3.wire.tls`);
* the keyword arguments botocore's connection errors are built with and keep in
  ``.kwargs`` (``endpoint_url``, ``error``; aiobotocore raises ``SSLError`` with aiohttp's
  exception as ``error``): s3ckpt's own transports raise the errors botocore would
  (:func:`read_timeout`, :func:`connect_timeout`, :func:`connection_failed`,
  :func:`tls_failed`), and messages read them back (:func:`failed_endpoint`,
  :func:`cause`, :mod:`s3ckpt.s3.error_mapping`).

* the ``after-call.s3`` event (``http_response``, ``parsed``), emitted with every answer
  the client parses, errors included, before it returns or raises: each answer's
  ``ResponseMetadata`` names the endpoint that gave it and the status it sent, which
  ``_handle_200_error`` may have turned into a 500 (:func:`note_endpoints`,
  :func:`answering_endpoint`, :func:`answered_status`; answers read on the data plane
  get them in :func:`client_error` and :func:`parsed_answer`), which errors name
  (:mod:`s3ckpt.s3.error_mapping`);
* ``botocore.configprovider.ConfiguredEndpointProvider``, the chain a session resolves a
  client's configured endpoint URL with (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``,
  the profile's services section, the profile's ``endpoint_url``: its
  ``_ENDPOINT_URL_LOOKUP_ORDER`` and ``_get_endpoint_url_<location>`` methods), which
  says where the endpoint a client uses came from (:func:`configured_endpoint`,
  :mod:`s3ckpt.catalog.doctor`).

``tests/unit/test_s3_compat.py`` fails loudly when a botocore release changes any of them.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from botocore import exceptions as bce
from botocore import handlers
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest, HeadersDict
from botocore.configprovider import ConfiguredEndpointProvider
from botocore.httpsession import create_urllib3_context, get_cert_path
from botocore.parsers import create_parser
from botocore.serialize import create_serializer
from botocore.session import Session
from botocore.utils import percent_encode_sequence

BEFORE_SIGN = "before-sign.s3.{operation}"
BEFORE_SEND = "before-send.s3.{operation}"
AFTER_CALL = "after-call.s3"
ENDPOINT_KEY = "S3ckptEndpoint"  # in an answer's ResponseMetadata: the endpoint that gave it
STATUS_KEY = "S3ckptStatus"  # and the status it sent (botocore reads a 200 it cannot parse as 500)


def on_before_sign(client: Any, operation: str, handler: Callable[..., Any]) -> None:
    """Call ``handler(request=..., **kwargs)`` on every ``operation`` request of
    ``client`` before it is signed; the handler may change its body and headers."""
    client.meta.events.register(BEFORE_SIGN.format(operation=operation), handler)


def on_before_send(client: Any, operation: str, handler: Callable[..., Any]) -> None:
    """Call ``handler(request=..., **kwargs)`` on every signed ``operation`` request of
    ``client``; a response it returns is used instead of sending the request."""
    client.meta.events.register(BEFORE_SEND.format(operation=operation), handler)


def note_endpoints(client: Any) -> None:
    """Name the client's endpoint in the ``ResponseMetadata`` of every answer it parses,
    successes and errors (a ``ClientError``'s ``response``) alike."""
    endpoint = client.meta.endpoint_url

    def note(parsed: Any = None, http_response: Any = None, **_: Any) -> None:
        if isinstance(parsed, dict):
            metadata = parsed.setdefault("ResponseMetadata", {})
            metadata[ENDPOINT_KEY] = endpoint
            metadata[STATUS_KEY] = getattr(http_response, "status_code", None)

    client.meta.events.register(AFTER_CALL, note)


def answering_endpoint(response: dict[str, Any]) -> str | None:
    """The endpoint that gave an answer (a parsed response or a ``ClientError``'s
    ``response``), where s3ckpt's client noted it."""
    endpoint = response.get("ResponseMetadata", {}).get(ENDPOINT_KEY)
    return str(endpoint) if endpoint else None


def answered_status(response: dict[str, Any]) -> int | None:
    """The HTTP status the endpoint sent with an answer, where s3ckpt's client noted it:
    ``HTTPStatusCode`` is 500 for a 200 whose body botocore could not read."""
    status = response.get("ResponseMetadata", {}).get(STATUS_KEY)
    return status if isinstance(status, int) else None


@dataclass(frozen=True)
class ConfiguredEndpoint:
    """Where the endpoint URL an S3 client uses was configured: ``location`` in botocore's
    words (``environment_service``: ``AWS_ENDPOINT_URL_S3``; ``environment_global``:
    ``AWS_ENDPOINT_URL``; ``config_service``: ``s3``'s ``endpoint_url`` in the services
    section ``services`` that the profile names; ``config_global``: the profile's own
    ``endpoint_url``), the profile and the config file read."""

    location: str
    profile: str
    config_file: str
    services: str | None


def configured_endpoint(profile: str | None, endpoint_url: str) -> ConfiguredEndpoint | None:
    """Where ``endpoint_url``, the endpoint of an S3 client made for ``profile`` (None: the
    environment's, else ``default``) without an explicit endpoint, was configured, looked
    up in botocore's own order; None when it was not configured (botocore's endpoint for
    the region, or a configured one that the client ignores)."""
    session = Session(profile=profile)
    scoped = session.get_scoped_config()
    chain = ConfiguredEndpointProvider(
        full_config=session.full_config, scoped_config=scoped, client_name="s3"
    )
    for location in chain._ENDPOINT_URL_LOOKUP_ORDER:
        found = getattr(chain, f"_get_endpoint_url_{location}")()
        if not found:
            continue
        if found.rstrip("/") != endpoint_url.rstrip("/"):
            return None
        config_file = os.path.expanduser(str(session.get_config_variable("config_file")))
        services = scoped.get("services")
        return ConfiguredEndpoint(
            str(location),
            session.profile or "default",
            config_file,
            str(services) if services else None,
        )
    return None


def ignored_s3_endpoint(profile: str | None) -> str | None:
    """An ``endpoint_url`` written in the profile's own ``s3`` section (``s3 =`` followed
    by indented settings, where botocore reads ``addressing_style`` and the like), which
    botocore does not use as an endpoint: only a services section's ``s3`` is read."""
    nested = Session(profile=profile).get_scoped_config().get("s3")
    found = nested.get("endpoint_url") if isinstance(nested, dict) else None
    return str(found) if found else None


def sign_s3(
    method: str,
    url: str,
    headers: dict[str, str],
    *,
    credentials: Any,
    region: str,
    service: str,
    client_config: Any,
) -> Any:
    """The headers (a mapping) of an S3 request signed with SigV4 as ``client_config``'s client signs
    (``UNSIGNED-PAYLOAD`` where it does not sign payloads): ``headers`` and the signer's."""
    if credentials is None:
        raise bce.NoCredentialsError()
    request = AWSRequest(method=method, url=url, headers=headers)
    request.context["client_config"] = client_config
    S3SigV4Auth(credentials, service, region).add_auth(request)
    return request.headers


def client_error(
    client: Any,
    operation: str,
    status: int,
    headers: dict[str, str],
    body: bytes,
    answered: int | None = None,
) -> bce.ClientError:
    """The exception ``client`` raises for an ``operation`` answered with an error: its
    modeled class for the code (a ``ClientError``), parsed by its own response parser;
    ``answered``: the status the endpoint sent, where :func:`answer_status` read it as
    another."""
    parsed = parsed_answer(client, operation, status, headers, body)
    parsed["ResponseMetadata"][STATUS_KEY] = status if answered is None else answered
    code = parsed.get("Error", {}).get("Code")
    error_class: type[bce.ClientError] = client.exceptions.from_code(code)
    return error_class(parsed, operation)


def parsed_answer(
    client: Any, operation: str, status: int, headers: dict[str, str], body: bytes
) -> dict[str, Any]:
    """An ``operation``'s answer as ``client``'s own response parser reads it: for a
    success, the dict the client's method returns, less what the client's event handlers
    do around parsing (``before-parse``: an unreadable ``Expires`` header kept as a
    string, a ``200`` that carries an error; ``after-call``: none for the operations the
    data plane sends)."""
    model = client.meta.service_model
    parser = create_parser(model.protocol)
    parsed: dict[str, Any] = parser.parse(
        {"status_code": status, "headers": HeadersDict(headers), "body": body},
        model.operation_model(operation).output_shape,
    )
    metadata = parsed.setdefault("ResponseMetadata", {})
    metadata[ENDPOINT_KEY] = client.meta.endpoint_url
    metadata.setdefault(STATUS_KEY, status)
    return parsed


@dataclass(frozen=True)
class SerializedRequest:
    """A request as botocore's serializer builds it: ``query`` is the URL's query as the
    client sends it (the operation's literal part first, then the encoded parameters),
    without the ``?``."""

    method: str
    query: str
    headers: dict[str, str]
    body: bytes


def serializer(client: Any) -> Any:
    """A request serializer for ``client``'s protocol, without parameter validation (the
    client s3ckpt makes validates none, :mod:`s3ckpt.s3.client`)."""
    return create_serializer(client.meta.service_model.protocol, include_validation=False)


def serialized(
    client: Any, serialize: Any, operation: str, params: dict[str, Any]
) -> SerializedRequest:
    """``operation`` with ``params`` (``Bucket`` included) as ``client`` would build it,
    before the handlers that run after serialization and before signing."""
    model = client.meta.service_model.operation_model(operation)
    request = serialize.serialize_to_request(params, model)
    literal = request["url_path"].partition("?")[2]  # the path is the caller's address
    encoded = percent_encode_sequence(request["query_string"])
    query = "&".join(part for part in (literal, encoded) if part)
    body = request["body"]
    if isinstance(body, str):
        body = body.encode("utf-8")
    headers = {name: str(value) for name, value in request["headers"].items()}
    return SerializedRequest(request["method"], query, headers, bytes(body or b""))


def escaped_xml(body: bytes) -> bytes:
    """A DeleteObjects body as the client sends it: carriage returns and line feeds in
    keys written as character references, so the server's XML parser keeps them."""
    params = {"body": body}
    handlers.escape_xml_payload(params)
    escaped: bytes = params["body"]
    return escaped


def answer_status(client: Any, operation: str, status: int, body: bytes) -> int:
    """The status the client reads an answer as: a ``200`` whose body is an S3 error
    document (S3 sends them for CompleteMultipartUpload, copies) or cut short is a ``500``."""
    answer = {"status_code": status, "body": body, "headers": {}}
    handlers._handle_200_error(client.meta.service_model.operation_model(operation), answer)
    changed: int = answer["status_code"]
    return changed


def decoded_listing(parsed: dict[str, Any]) -> dict[str, Any]:
    """A ListObjectsV2 answer asked with ``EncodingType=url`` (as the client asks when the
    caller does not) with its keys and prefixes decoded, as the client returns it."""
    handlers.decode_list_object_v2(parsed, {"encoding_type_auto_set": True})
    return parsed


def default_tls_context() -> ssl.SSLContext:
    """A client TLS context with botocore's defaults (protocols, options, ciphers), before
    any verification settings."""
    return create_urllib3_context()


def ca_bundle(verify: bool | str) -> str | None:
    """The CA bundle botocore verifies with for a true ``verify`` (its own bundle for
    ``True``, the file for a path)."""
    path: str | None = get_cert_path(verify)
    return path


def no_credentials() -> bce.NoCredentialsError:
    """What the client raises when it has no credentials to sign with."""
    return bce.NoCredentialsError()


def read_timeout(endpoint_url: str) -> bce.ReadTimeoutError:
    return bce.ReadTimeoutError(endpoint_url=endpoint_url)


def connect_timeout(endpoint_url: str) -> bce.ConnectTimeoutError:
    return bce.ConnectTimeoutError(endpoint_url=endpoint_url)


def connection_failed(endpoint_url: str, error: BaseException) -> bce.EndpointConnectionError:
    return bce.EndpointConnectionError(endpoint_url=endpoint_url, error=error)


def tls_failed(endpoint_url: str, error: BaseException) -> bce.SSLError:
    return bce.SSLError(endpoint_url=endpoint_url, error=error)


def failed_endpoint(exc: bce.BotoCoreError, default: str) -> Any:
    """The endpoint a botocore connection error names, else ``default``."""
    return exc.kwargs.get("endpoint_url", default)


def cause(exc: bce.BotoCoreError) -> Any:
    """The exception a botocore connection error wraps (``None`` if it wraps none)."""
    return exc.kwargs.get("error")


__all__ = [
    "AFTER_CALL",
    "BEFORE_SEND",
    "BEFORE_SIGN",
    "ENDPOINT_KEY",
    "STATUS_KEY",
    "ConfiguredEndpoint",
    "SerializedRequest",
    "answer_status",
    "answered_status",
    "answering_endpoint",
    "ca_bundle",
    "cause",
    "client_error",
    "configured_endpoint",
    "connect_timeout",
    "connection_failed",
    "decoded_listing",
    "default_tls_context",
    "escaped_xml",
    "failed_endpoint",
    "ignored_s3_endpoint",
    "note_endpoints",
    "on_before_send",
    "on_before_sign",
    "read_timeout",
    "serialized",
    "serializer",
    "sign_s3",
    "tls_failed",
]
