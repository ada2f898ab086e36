"""Per-source access: credentials, the User-Agent and a request rate, applied to every request hop.

Why a hook on the one Fetcher rather than a client per source: the per-host limits, retries and metrics
stay in one place, and a request learns its source from ``scope.current_source``. Every entry point of
harvest/ that works for a source (a sync, an audit, a retry, a check of what is still listed, a
notification's changes...) is wrapped in ``for_source``, which sets it for exactly the work done inside
(and the Fetcher carries it into its download tasks): whoever calls an entry point — the daemon, ``rsagg
audit``, a subscriber — its requests carry that source's credentials, rate and address rules
(tests/test_source_context.py holds every public entry point of harvest/ to that).

Rules (secrets never leak):
- secrets are read from a file or an environment variable that the config names (``[sources.auth]``),
  never from the config itself, once when a harvest starts; a missing one is a ConfigError naming the
  key and the file or variable, never the value;
- credentials go only to the source's own origin (scheme, host, port of its ``url``): on every hop,
  the Authorization and custom headers are set for that origin and removed for any other (a mirror,
  a redirect elsewhere);
- nothing here logs a header value; FetchError messages carry URLs and statuses only.
"""

from __future__ import annotations

import base64
import functools
import inspect
import os
from collections.abc import AsyncGenerator, Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import trio

from .. import PROJECT_URL, __version__
from ..config import Config, ConfigError, SourceConfig
from ..redact import add_secrets
from ..scope import current_source

DEFAULT_USER_AGENT = f"rsagg/{__version__} (+{PROJECT_URL})"

F = TypeVar("F", bound=Callable[..., Any])


@contextmanager
def acting_for(source: str) -> Iterator[None]:
    """The requests made inside are made for ``source`` (its credentials, rate, metrics label)."""
    token = current_source.set(source)
    try:
        yield
    finally:
        current_source.reset(token)


def _source_getter(fn: Callable[..., Any]) -> Callable[[tuple, dict], str]:
    """How a call of ``fn`` names the source it works for: its ``src`` (a SourceConfig) or ``source`` (a
    name) argument, else its object's (``self``) ``source`` or ``src``. Decided once per function: the
    call itself only indexes its arguments."""
    names = list(inspect.signature(fn).parameters)
    for param, of in (("src", lambda v: v.name), ("source", lambda v: v)):
        if param in names:
            at = names.index(param)
            return lambda args, kwargs: of(kwargs[param] if param in kwargs else args[at])
    if names and names[0] == "self":

        def of_self(args: tuple, kwargs: dict) -> str:
            name = getattr(args[0], "source", None)
            return name if isinstance(name, str) else args[0].src.name

        return of_self
    raise TypeError(f"{fn.__qualname__}: names no source (src, source, self.source or self.src)")


def for_source(fn: F) -> F:
    """Run the coroutine or async generator function ``fn`` as work for the source its arguments name.

    Why a wrapper, not a ``current_source.set`` at the top of each: a bare ``set`` in a coroutine stays
    set in its caller after it returns, and in an async generator it changes the context of whoever
    iterates it. Here the source is set around each step of the work only (an async generator's body
    runs with it, its consumer between two items does not), and nested entry points for the same source
    compose. Cost: about a microsecond per item or call (benchmarks/bench_for_source.py)."""
    source_of = _source_getter(fn)
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def steps(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
            name = source_of(args, kwargs)
            inner = fn(*args, **kwargs)
            step = inner.__anext__
            try:
                while True:
                    token = current_source.set(name)
                    try:
                        item = await step()
                    except StopAsyncIteration:
                        return
                    finally:
                        current_source.reset(token)
                    yield item
            finally:
                with acting_for(name):
                    await inner.aclose()

        wrapper: Any = steps
    elif inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def call(*args: Any, **kwargs: Any) -> Any:
            token = current_source.set(source_of(args, kwargs))
            try:
                return await fn(*args, **kwargs)
            finally:
                current_source.reset(token)

        wrapper = call
    else:
        raise TypeError(f"{fn.__qualname__}: for_source wraps coroutine or async generator functions")
    wrapper.__for_source__ = True
    return wrapper


def user_agent(config: Config) -> str:
    return config.harvest.user_agent or DEFAULT_USER_AGENT


def _origin(url: httpx.URL) -> tuple[str, str, int | None]:
    port = url.port or {"http": 80, "https": 443}.get(url.scheme)
    return url.scheme, url.host, port


@functools.lru_cache(maxsize=1024)  # a pure function of the text: a reload asks again for every Source
def _url_origin(url: str) -> tuple[str, str, int | None]:
    """``_origin`` of a configured URL, parsed by httpx as the requests' URLs are."""
    return _origin(httpx.URL(url))


def _read_secret(config: Config, key: str, ref: str, how: str) -> str:
    """The value a ``file``/``env`` reference names; errors name the reference, never a value."""
    if how == "env":
        value = os.environ.get(ref)
        if value is None or not value.strip():
            raise ConfigError(config.file, key, f"environment variable {ref} is not set or empty")
        return value.strip()
    path = Path(ref)
    if not path.is_absolute() and config.file != "<defaults>":
        path = Path(config.file).parent / path
    try:
        value = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise ConfigError(config.file, key, f"cannot read secret file {path}: {reason}") from None
    if not value:
        raise ConfigError(config.file, key, f"secret file {path} is empty")
    return value


def resolve_headers(config: Config, index: int, src: SourceConfig) -> dict[str, str]:
    """The headers ``[sources.auth]`` asks for, secrets read now."""
    if not src.auth:  # most sources: nothing to read, nothing to scrub from the logs
        return {}
    auth, prefix = src.auth, f"sources[{index}].auth"
    out: dict[str, str] = {}
    for how in ("file", "env"):
        ref = auth.get(f"bearer_token_{how}")
        if ref:
            out["Authorization"] = "Bearer " + _read_secret(config, f"{prefix}.bearer_token_{how}", ref, how)
        ref = auth.get(f"basic_password_{how}")
        if ref:
            password = _read_secret(config, f"{prefix}.basic_password_{how}", ref, how)
            add_secrets([password])
            pair = f"{auth['basic_username']}:{password}".encode()
            out["Authorization"] = "Basic " + base64.b64encode(pair).decode("ascii")
    for name, ref in auth.get("headers", {}).items():
        how, _, where = ref.partition(":")
        value = _read_secret(config, f"{prefix}.headers.{name}", where, how)
        if any(ord(c) < 32 for c in value):
            raise ConfigError(config.file, f"{prefix}.headers.{name}", "the value holds control characters")
        out[name] = value
    # Never in a log line, whoever logs it (logs.py): the header values, the password, the token alone.
    add_secrets([*out.values(), *(v.split(" ", 1)[-1] for v in out.values())])
    return out


class _Pace:
    """At most ``rate`` request starts per second (an even spacing, no bursts); shared by all tasks."""

    def __init__(self, rate: float) -> None:
        self.interval = 1.0 / rate
        self.next = 0.0
        self.lock = trio.Lock()

    async def wait(self) -> None:
        async with self.lock:
            now = trio.current_time()
            if self.next > now:
                await trio.sleep_until(self.next)
                now = self.next
            self.next = now + self.interval


class SourceAccess:
    """What one source's requests carry and how fast they may go."""

    def __init__(self, url: str, headers: Mapping[str, str], max_rate: float) -> None:
        self.url = url
        self.rate = max_rate
        self.headers = dict(headers)
        self._names = [h.lower() for h in self.headers]
        self._pace = _Pace(max_rate) if max_rate > 0 else None
        #: Parsed now only where it is used, for a source with headers (a URL httpx cannot read stops
        #: the start, as before); a source without any never needs it (httpx's parse was about 1,400
        #: of the ~9,000 Python opcodes each of 300 small Sources cost before its first request).
        self._own_origin = _url_origin(url) if self.headers else None

    @property
    def origin(self) -> tuple[str, str, int | None]:
        """(scheme, host, port) of the source's ``url``: the only origin its headers go to."""
        if self._own_origin is None:
            self._own_origin = _url_origin(self.url)
        return self._own_origin

    @property
    def acts(self) -> bool:
        """``prepare`` has something to do: a pace to keep or headers to set."""
        return self._pace is not None or bool(self.headers)

    async def prepare(self, request: httpx.Request) -> None:
        if self._pace is not None:
            await self._pace.wait()
        if not self.headers:
            return
        if _origin(request.url) == self.origin:
            request.headers.update(self.headers)
        else:  # a redirect or mirror elsewhere: nothing of ours travels there
            for name in self._names:
                request.headers.pop(name, None)


class Access:
    """The Fetcher's ``request_hook``: each hop of a request made for a source gets that source's rules.

    It follows the running configuration (``running``): after a reload (SIGHUP) each source's secrets
    are read again at its next request, and an added or changed source gets its credentials and rate.
    """

    def __init__(
        self,
        config: Config,
        sources: Collection[str] | None = None,
        *,
        running: Callable[[], Config] | None = None,
    ) -> None:
        """Reads the secrets of ``sources`` (names; None: every source) of ``config`` now, so that a
        missing one stops the start; a command working on some sources (``--source``) needs only theirs.
        Any other source's are read at its first request. ``running``: the running configuration (the
        harvest context's, which a reload replaces); None: ``config`` for good."""
        self._config: Callable[[], Config] = running or (lambda: config)
        self._by_source: dict[str, tuple[Config, SourceAccess]] = {}
        #: The configuration last looked at, its sources by name (and their place in ``sources``): a
        #: request finds its source in one step, not by a scan of every source (quadratic in them).
        self._named: tuple[Config | None, dict[str, tuple[int, SourceConfig]]] = (None, {})
        for src in config.sources:
            if sources is None or src.name in sources:
                self._access(config, src)

    def _access(self, config: Config, src: SourceConfig) -> SourceAccess:
        """The source's access under ``config``; its secrets are read again for each new configuration
        (a reload re-reads a rotated token), its pace kept while its rate stays the same."""
        known = self._by_source.get(src.name)
        if known is not None and known[0] is config:
            return known[1]
        rate = config.max_rate(src)
        index = self._sources(config).get(src.name, (None, None))[0]
        if index is None or config.sources[index] is not src:
            index = config.sources.index(src)
        access = SourceAccess(src.url, resolve_headers(config, index, src), rate)
        if known is not None and known[1].rate == rate:
            access._pace = known[1]._pace
        self._by_source[src.name] = (config, access)
        return access

    async def __call__(self, request: httpx.Request) -> None:
        config = self._config()
        request.headers["User-Agent"] = user_agent(config)
        name = current_source.get()
        if not name:
            return
        found = self._sources(config).get(name)
        if found is not None:
            access = self._access(config, found[1])
            if access.acts:  # else no coroutine for nothing on every request
                await access.prepare(request)

    def paces(self) -> bool:
        """The requests of the source this task acts for keep a pace (``max_rate``): the Fetcher keeps
        no request slot between its GETs (``Fetcher.keeping_slots``)."""
        config = self._config()
        found = self._sources(config).get(current_source.get() or "")
        return found is not None and self._access(config, found[1])._pace is not None

    def _sources(self, config: Config) -> dict[str, tuple[int, SourceConfig]]:
        """``config``'s sources by name, with their index (the first of a name, as a scan finds it)."""
        known, named = self._named
        if known is not config:
            named = {}
            for i, src in enumerate(config.sources):
                named.setdefault(src.name, (i, src))
            self._named = (config, named)
        return named
