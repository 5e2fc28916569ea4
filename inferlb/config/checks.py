"""The run-time checks a parsed config must pass before any service applies it, shared by all of them.

:func:`inferlb.config.schema.parse_config` checks a document against the schema. Serving it needs more, from
the machine it runs on: each model's ``tokenizer`` must load (ext_proc counts prompt tokens with it) and each
endpoint's host name must resolve (EDS endpoints are IP addresses, so xds_server resolves them). ext_proc
and xds_server follow the same file on their own, so if each checked only what it needs, a file one of them
refused could be applied by the other: a version renamed in the file then reaches Envoy's routes while
ext_proc keeps naming the old one, and every request of that model is a 404. Both call
:func:`check_config` at start-up and on every reload, and ``inferlb validate`` does too, so a file is
served by both or by neither.

No servers here; the I/O is the tokenizer file read (cached by file identity, see
:class:`TokenizerCache`) and the host lookups (through an injectable :data:`HostResolver`).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from inferlb.config.schema import Config
from inferlb.errors import ConfigError
from inferlb.request.tokens import TextTokenCounter, make_counter

#: Resolves one host name to one IP literal; raises OSError (e.g. ``socket.gaierror``) when it cannot.
HostResolver = Callable[[str], Awaitable[str]]

#: Tokenizer specs a :class:`TokenizerCache` keeps (least recently used dropped first): far more distinct
#: tokenizers than any fleet serves at once, while bounding what many reloads with new files can pin.
TOKENIZER_CACHE_ENTRIES: Final = 32


async def system_resolve(name: str) -> str:
    """Resolve a host name with the event loop's ``getaddrinfo`` (the system resolver: /etc/hosts, DNS, a
    container network's service names), preferring an IPv4 answer since Envoy's default listeners and
    most fleets are IPv4.

    Raises:
        OSError: the name does not resolve (``socket.gaierror``) or has no address.
    """
    answer = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
    ipv4 = [a for a in answer if a[0] == socket.AF_INET]
    if not answer:
        raise OSError("no address")
    return str((ipv4 or answer)[0][4][0])


async def lookup_hosts(names: Sequence[str], resolve: HostResolver) -> tuple[dict[str, str], dict[str, str]]:
    """Resolve every name concurrently. Returns ``({name: IP}, {name: why it failed})``: any exception of
    ``resolve`` is a failed lookup (``getaddrinfo`` raises ``UnicodeError`` for some malformed names)."""
    answers = await asyncio.gather(*(resolve(n) for n in names), return_exceptions=True)
    resolved: dict[str, str] = {}
    failed: dict[str, str] = {}
    for name, answer in zip(names, answers, strict=True):
        if isinstance(answer, BaseException):
            if not isinstance(answer, Exception):  # cancellation, not a failed lookup
                raise answer
            failed[name] = str(answer) or type(answer).__name__
        else:
            resolved[name] = answer
    return resolved, failed


def host_names(config: Config) -> list[str]:
    """The distinct host names (not IP literals) among ``config.endpoints``, sorted."""
    return sorted({e.address.host for e in config.endpoints if not e.address.is_ip})


def _host_problems(config: Config, failed: Mapping[str, str]) -> list[tuple[str, str]]:
    return [
        (
            f"endpoints[{i}].address",
            f"host name {e.address.host!r} does not resolve: {failed[e.address.host]}",
        )
        for i, e in enumerate(config.endpoints)
        if e.address.host in failed
    ]


async def resolve_endpoint_hosts(
    config: Config,
    source: str,
    resolve: HostResolver = system_resolve,
    *,
    known: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Resolve every endpoint host name of a config to one IP address (EDS endpoints must be IPs).

    IP literals are left alone and not looked up. ``resolve`` is :func:`system_resolve` by default.

    Args:
        known: ``{host name: IP}`` already resolved for this change (not looked up again; kept in the
            answer when still used).

    Returns:
        ``{host name: IP literal}`` for every distinct host name among ``config.endpoints``.

    Raises:
        ConfigError: naming ``endpoints[i].address`` for each endpoint whose host name does not resolve.
    """
    names = host_names(config)
    done = known or {}
    resolved, failed = await lookup_hosts([n for n in names if n not in done], resolve)
    problems = _host_problems(config, failed)
    if problems:
        raise ConfigError(source, problems)
    return {**{n: done[n] for n in names if n in done}, **resolved}


def _file_identity(spec: str) -> tuple[int, int, int] | None:
    """``(inode, size, mtime ns)`` of an ``hf:`` spec's file, None for specs without a file (or when it
    cannot be stat'ed: loading then fails with the reason)."""
    kind, _, path = spec.partition(":")
    if kind != "hf":
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class TokenizerCache:
    """Tokenizer spec -> its counter, loaded with :func:`inferlb.request.tokens.make_counter` and kept while
    the spec's file is unchanged, so a reload of a config naming the same ``hf:`` file does not read and
    parse it again (a ``tokenizer.json`` is megabytes). An ``hf:`` file replaced on disk (another inode,
    size or mtime) is loaded again; a file that is gone is an error even when it was loaded before (a
    restart could not load it). Thread-safe (loads run in a worker thread); at most ``max_entries`` specs.
    """

    def __init__(self, max_entries: int = TOKENIZER_CACHE_ENTRIES) -> None:
        self._max_entries = max_entries
        self._entries: OrderedDict[str, tuple[tuple[int, int, int] | None, TextTokenCounter]] = OrderedDict()
        self._lock = threading.Lock()
        #: how many times a spec was actually loaded (not served from the cache)
        self.loads = 0

    def load(self, spec: str) -> TextTokenCounter:
        """The counter of ``spec`` (cached while its file is unchanged).

        Raises:
            ValueError: an unknown spec, an encoding not bundled offline, a missing or unloadable file.
        """
        identity = _file_identity(spec)
        with self._lock:
            hit = self._entries.get(spec)
            if hit is not None and hit[0] == identity:
                self._entries.move_to_end(spec)
                return hit[1]
        counter = make_counter(spec)  # outside the lock: loading a file takes a while
        with self._lock:
            self.loads += 1
            self._entries[spec] = (identity, counter)
            self._entries.move_to_end(spec)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)
        return counter


#: The process's tokenizer cache: the checks and ext_proc's gateway share it, so a file checked on reload
#: is not loaded a second time when the gateway is built.
SHARED_TOKENIZERS: Final = TokenizerCache()


def load_tokenizers(
    config: Config, source: str, cache: TokenizerCache = SHARED_TOKENIZERS
) -> dict[str, TextTokenCounter]:
    """Load every model's tokenizer. Returns ``{tokenizer spec: counter}``.

    Raises:
        ConfigError: naming ``models[i].tokenizer`` for each model whose tokenizer cannot be loaded.
    """
    counters: dict[str, TextTokenCounter] = {}
    failed: dict[str, str] = {}
    for m in config.models:
        if m.tokenizer in counters or m.tokenizer in failed:
            continue
        try:
            counters[m.tokenizer] = cache.load(m.tokenizer)
        except ValueError as exc:
            failed[m.tokenizer] = str(exc)
    problems = [
        (f"models[{i}].tokenizer", f"model {m.name!r}: {failed[m.tokenizer]}")
        for i, m in enumerate(config.models)
        if m.tokenizer in failed
    ]
    if problems:
        raise ConfigError(source, problems)
    return counters


@dataclass(frozen=True, kw_only=True)
class CheckedConfig:
    """A config that passed :func:`check_config`, with what the checks found.

    Attributes:
        config: the config checked.
        resolved_hosts: ``{host name: IP literal}`` for every endpoint written with a host name.
        counters: ``{tokenizer spec: counter}`` for every model's tokenizer.
    """

    config: Config
    resolved_hosts: Mapping[str, str]
    counters: Mapping[str, TextTokenCounter]


async def check_config(
    config: Config,
    source: str,
    *,
    resolve: HostResolver = system_resolve,
    tokenizers: TokenizerCache = SHARED_TOKENIZERS,
) -> CheckedConfig:
    """Everything a service needs from this machine to serve ``config``: each model's tokenizer loads and
    each endpoint's host name resolves. ext_proc, xds_server (start-up and every reload) and ``inferlb
    validate`` all call this, so a file one of them refuses is refused by all.

    Args:
        config: a config that passed :func:`inferlb.config.schema.parse_config`.
        source: the file it came from, for error messages.
        resolve: the host resolver (:func:`system_resolve`; tests inject one).
        tokenizers: the tokenizer cache (the process's :data:`SHARED_TOKENIZERS` by default).

    Raises:
        ConfigError: every problem found, each naming its field (``models[i].tokenizer``,
            ``endpoints[i].address``) and ``source``.
    """

    async def tokenizer_check() -> tuple[dict[str, TextTokenCounter], list[tuple[str, str]]]:
        try:  # a worker thread: an hf: file takes a while to parse, and the loop keeps serving
            return await asyncio.to_thread(load_tokenizers, config, source, tokenizers), []
        except ConfigError as err:
            return {}, err.problems

    (counters, problems), (resolved, failed) = await asyncio.gather(
        tokenizer_check(), lookup_hosts(host_names(config), resolve)
    )
    problems = [*problems, *_host_problems(config, failed)]
    if problems:
        raise ConfigError(source, problems)
    return CheckedConfig(config=config, resolved_hosts=resolved, counters=counters)


def check_config_sync(config: Config, source: str) -> CheckedConfig:
    """:func:`check_config` for callers without an event loop (``inferlb validate``).

    Raises:
        ConfigError: as :func:`check_config`.
    """
    return asyncio.run(check_config(config, source))
