"""Kafka client factories, starts and stops: every client gets the configured security and size
settings, every client starts through :func:`start_client`, which waits out a broker that
cannot be reached (down, restarting) for ``kafka.outage_patience_seconds``, and stops through
:func:`stop_client`, which never waits longer than its deadline."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.conn import create_conn
from aiokafka.errors import (
    AuthenticationFailedError,
    AuthenticationMethodNotSupported,
    IllegalSaslStateError,
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    SaslAuthenticationFailed,
    UnsupportedSaslMechanismError,
)
from aiokafka.helpers import create_ssl_context

from rollstream.config import KafkaConfig
from rollstream.retry import KAFKA_RETRY
from rollstream.runtime.deadline import CancelledInside, DeadlineExceeded, within

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long a client's stop may take: a consumer leaves its group, a producer delivers what it
# holds (each within kafka.request_timeout_ms; a stop past this is stuck, not slow).
STOP_TIMEOUT_SECONDS = 45.0


# A broker that answers these will answer them again: wrong credentials or TLS settings.
REFUSALS = (
    SaslAuthenticationFailed,
    AuthenticationFailedError,
    AuthenticationMethodNotSupported,
    UnsupportedSaslMechanismError,
    IllegalSaslStateError,
    ssl.SSLError,
)


class KafkaAuthenticationError(RuntimeError):
    """The broker refused this client's credentials or TLS settings (never worth retrying)."""


def connection_kwargs(config: KafkaConfig, client_id: str) -> dict[str, Any]:
    """aiokafka keyword arguments every client gets: its id, the request timeout, and the
    settings of the configured security protocol."""
    kwargs: dict[str, Any] = {
        "client_id": f"{config.client_id_prefix}-{client_id}",
        "request_timeout_ms": config.request_timeout_ms,
        "security_protocol": config.security_protocol,
    }
    if config.security_protocol in ("SASL_PLAINTEXT", "SASL_SSL"):  # KafkaConfig checks the mechanism and user
        kwargs.update(
            sasl_mechanism=config.sasl_mechanism,
            sasl_plain_username=config.sasl_username,
            sasl_plain_password=config.sasl_password or "",
        )
    if config.security_protocol in ("SSL", "SASL_SSL"):
        kwargs["ssl_context"] = create_ssl_context(
            cafile=config.ssl_cafile,
            certfile=config.ssl_certfile,
            keyfile=config.ssl_keyfile,
            password=config.ssl_password,
        )
    return kwargs


def make_producer(
    config: KafkaConfig,
    client_id: str,
    *,
    transactional_id: str | None = None,
) -> AIOKafkaProducer:
    """An idempotent producer (acks=all); transactional when ``transactional_id`` is given.

    Batches wait up to ``config.linger_ms`` for more records (a transaction's commit sends
    what is waiting at once)."""
    return AIOKafkaProducer(
        bootstrap_servers=config.bootstrap_servers,
        enable_idempotence=True,
        acks="all",
        transactional_id=transactional_id,
        transaction_timeout_ms=config.transaction_timeout_ms,
        max_request_size=config.max_message_bytes,
        # The broker applies a topic's max.message.bytes to whole record batches: a batch may
        # not outgrow the limit, or records that each fit are refused together.
        max_batch_size=min(1024 * 1024, config.max_message_bytes),
        linger_ms=config.linger_ms,
        **connection_kwargs(config, client_id),
    )


def make_consumer(
    config: KafkaConfig,
    client_id: str,
    *topics: str,
    group_id: str | None,
    read_committed: bool = True,
    auto_offset_reset: str = "earliest",
    max_poll_records: int | None = 500,
    **extra: Any,
) -> AIOKafkaConsumer:
    """A consumer with manual commits; ``read_committed`` unless told otherwise.

    Fetches wait at the broker for ``config.fetch_min_bytes`` or ``config.fetch_max_wait_ms``."""
    return AIOKafkaConsumer(
        *topics,
        bootstrap_servers=config.bootstrap_servers,
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset=auto_offset_reset,
        isolation_level="read_committed" if read_committed else "read_uncommitted",
        max_partition_fetch_bytes=config.max_message_bytes,
        fetch_max_bytes=max(config.max_message_bytes, 52428800),
        max_poll_records=max_poll_records,
        fetch_min_bytes=config.fetch_min_bytes,
        fetch_max_wait_ms=config.fetch_max_wait_ms,
        **connection_kwargs(config, client_id),
        **extra,
    )


def make_admin(config: KafkaConfig, client_id: str = "admin") -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(bootstrap_servers=config.bootstrap_servers, **connection_kwargs(config, client_id))


async def authentication_refusal(config: KafkaConfig) -> KafkaAuthenticationError | None:
    """Why the bootstrap servers refuse this client, when it is authentication or TLS; else None.

    aiokafka reports a refused login only as "Unable to bootstrap" (the real cause is logged
    and dropped), which looks like a broker that is down. One direct connection with the same
    security settings tells the two apart. The message names the settings, never a secret.
    """
    for server in config.bootstrap_servers.split(","):
        host, _, port = server.strip().rpartition(":")
        try:
            conn = await asyncio.wait_for(
                create_conn(host, int(port), **connection_kwargs(config, "probe")),
                config.request_timeout_ms / 1000,
            )
        except REFUSALS as exc:
            return KafkaAuthenticationError(
                f"kafka at {server.strip()} refused this client ({type(exc).__name__}: {exc}); check "
                f"kafka.security_protocol={config.security_protocol}, kafka.sasl_mechanism="
                f"{config.sasl_mechanism}, kafka.sasl_username={config.sasl_username!r}, "
                "kafka.sasl_password and the kafka.ssl_* files"
            )
        except Exception:  # down or unreachable: not an authentication problem
            continue
        conn.close()
    return None


def transient(exc: BaseException) -> bool:
    """A broker that is down, restarting or electing a controller: worth waiting for."""
    if isinstance(exc, (KafkaTimeoutError, asyncio.TimeoutError)):
        return True
    return isinstance(exc, KafkaError) and bool(getattr(exc, "retriable", False))


def broker_away(exc: BaseException, what: str) -> KafkaConnectionError | None:
    """The broker being away, however aiokafka said it, as a connection error naming ``what``;
    None for any other error. Besides a connection error itself, aiokafka's producer start says
    it two more ways while it looks up its transaction coordinator: an assertion that it knows
    no broker (a broker restarting between the bootstrap and the lookup), and a plain
    ``KafkaError`` wrapping a connection lost during the lookup (the cause kept)."""
    if isinstance(exc, KafkaConnectionError):
        return exc
    lost_bootstrap = isinstance(exc, AssertionError) and "bootstrap" in str(exc)
    wrapped = type(exc) is KafkaError and exc.__cause__ is not None and transient(exc.__cause__)
    if not (lost_bootstrap or wrapped):
        return None
    away = KafkaConnectionError(f"no broker reachable while {what}: {exc}")
    away.__cause__ = exc
    return away


async def wait_out_outage(
    config: KafkaConfig, fn: Callable[[], Awaitable[T]], what: str, patience: float | None = None
) -> T:
    """``await fn()``, retried with the one retry policy while the broker cannot be reached
    (:func:`transient` errors), each try logged, until the failures have gone on for
    ``patience`` seconds (default ``config.outage_patience_seconds``); then
    ``KafkaTimeoutError`` naming ``what``, the setting and the last error. A try that is slow
    but not failing (a consumer waiting for its group's assignment) is never cut short. A
    broker that refuses the configured credentials or TLS settings raises
    :class:`KafkaAuthenticationError` at once (aiokafka reports it as the same "Unable to
    bootstrap" as a broker that is down). Other errors propagate at once.
    """
    patience = config.outage_patience_seconds if patience is None else patience
    policy = dataclasses.replace(KAFKA_RETRY, patience=patience)
    tries = 0
    announced = False
    began = time.monotonic()

    async def once() -> T:
        nonlocal tries, announced
        tries += 1
        try:
            return await fn()
        except (AssertionError, KafkaError) as exc:
            away = broker_away(exc, what)
            if away is None:
                raise
            refusal = await authentication_refusal(config)
            if refusal is not None:
                raise refusal from away
            if not announced:
                announced = True
                log.warning("kafka at %s cannot be reached while %s; waiting up to %.0fs for it "
                            "(kafka.outage_patience_seconds)", config.bootstrap_servers, what, patience)
            raise away

    try:
        return await policy.call(once, retry_on=transient, what=f"{what} (kafka at {config.bootstrap_servers})")
    except Exception as exc:
        if not transient(exc):
            raise
        raise KafkaTimeoutError(
            f"kafka at {config.bootstrap_servers} not ready after {patience:.0f}s ({tries} tries in "
            f"{time.monotonic() - began:.0f}s) while {what} (kafka.outage_patience_seconds); "
            f"last error: {type(exc).__name__}: {exc}"
        ) from exc


class Startable(Protocol):
    async def start(self) -> Any: ...


async def start_client(client: Startable, config: KafkaConfig, what: str) -> None:
    """``await client.start()`` (a consumer, a producer, an admin client, a
    :class:`~rollstream.kafka.transactions.TransactionalProducer`), waiting out an
    unreachable broker as :func:`wait_out_outage` says. Every tier starts its clients here.

    Trying ``start()`` again on the same client is what aiokafka allows after a failed
    bootstrap: the client holds no connection or task until bootstrap succeeded (a consumer
    creates its fetcher after it). A TransactionalProducer builds a new producer per try.
    """
    await wait_out_outage(config, client.start, f"starting {what}")
    log.debug("started %s", what)


async def stop_client(client: Any, what: str, timeout: float = STOP_TIMEOUT_SECONDS) -> bool:
    """Stop ``client`` (``stop()``, or ``close()`` for an admin client) within ``timeout``
    seconds; True when it stopped cleanly. A stop that fails is logged; one that outlasts the
    deadline is cancelled and left behind (``rollstream.runtime.deadline``: aiokafka's fetcher
    close can swallow its cancellation) and logged as an error naming ``what``: a shutdown
    never hangs on a client."""
    stop = client.stop if hasattr(client, "stop") else client.close
    try:
        await within(stop(), timeout, f"stopping {what}")
    except DeadlineExceeded as exc:
        log.error("%s; going on without it", exc)
        return False
    except (KafkaError, OSError, CancelledInside) as exc:
        log.warning("stopping %s: %s: %s", what, type(exc).__name__, exc)
        return False
    return True
