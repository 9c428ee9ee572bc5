"""What a site's ``redis_url`` names: one Redis server, or a Sentinel set that names the master.

- ``redis://[user:password@]host:port/db`` (also ``rediss://`` and ``unix://``): one server;
- ``sentinel://[:password@]host:port[,host:port...]/service[/db]``: the Sentinels of a
  replicated Redis, and the name they monitor it under (Sentinel's ``master-name``). Every
  client drsvc opens (Celery's broker and result backend, the scheduler, slots, presence,
  the bandwidth buckets) asks them for the master, and asks again when the master fails
  over, so the control plane survives the loss of its Redis master.

The password, when given (``DRSVC_REDIS_PASSWORD``, merged by drsvc.config), is the one the
master and its replicas require (``requirepass``/``masterauth``); the Sentinels themselves
take none. Parsing is pure: the clients are built at the edge (``workers.redis_client``).
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit, urlunsplit

PLAIN_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_PORT = 26379


class RedisUrlInvalid(ValueError):
    """A redis_url that names neither a server nor a Sentinel set; the message says why."""


class PasswordGivenTwice(RedisUrlInvalid):
    """The URL carries a password and one is given besides."""


@dataclass(frozen=True)
class SentinelSet:
    sentinels: tuple          # ((host, port), ...)
    service: str
    db: int = 0
    password: str | None = None

    def url(self) -> str:
        """The canonical form, password included (never logged: see :func:`redacted`)."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        hosts = ",".join(f"{_host(h)}:{p}" for h, p in self.sentinels)
        return f"sentinel://{auth}{hosts}/{self.service}/{self.db}"

    def each_sentinel(self) -> list[str]:
        """One ``sentinel://[:password@]host:port/db`` per Sentinel: kombu's and Celery's form
        (joined by ``;``, with the service as the transport option ``master_name``)."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return [f"sentinel://{auth}{_host(h)}:{p}/{self.db}" for h, p in self.sentinels]


def is_sentinel(url: str) -> bool:
    return url.startswith("sentinel://")


def parse_sentinel(url: str) -> SentinelSet:
    """``sentinel://[:password@]h1:p1,h2:p2/service[/db]`` -> SentinelSet."""
    rest = url[len("sentinel://"):]
    auth, _, rest = rest.rpartition("@")
    hosts, _, path = rest.partition("/")
    password = unquote(auth.split(":", 1)[1]) if ":" in auth else (unquote(auth) or None)
    sentinels = tuple(_hostport(h, url) for h in hosts.split(",") if h)
    if not sentinels:
        raise RedisUrlInvalid(f"redis_url {redacted(url)!r} names no Sentinel: sentinel://host:port[,host:port]/service")
    parts = [p for p in path.split("/") if p]
    if not parts:
        raise RedisUrlInvalid(f"redis_url {redacted(url)!r} names no service: add /NAME, the master-name the "
                              "Sentinels monitor (sentinel://host:port,host:port/NAME)")
    if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise RedisUrlInvalid(f"redis_url {redacted(url)!r}: after the hosts comes /service or /service/db "
                              "(a database number)")
    return SentinelSet(sentinels=sentinels, service=parts[0], db=int(parts[1]) if len(parts) == 2 else 0,
                       password=password)


def check(url: str) -> str:
    """*url* if it names a server or a Sentinel set; RedisUrlInvalid otherwise."""
    if is_sentinel(url):
        parse_sentinel(url)
        return url
    scheme = urlsplit(url).scheme
    if scheme not in PLAIN_SCHEMES:
        raise RedisUrlInvalid(f"redis_url {redacted(url)!r}: the scheme must be redis://, rediss://, unix:// or "
                              "sentinel://")
    return url


def with_password(url: str, password: str) -> str:
    """*url* carrying *password* (RedisUrlInvalid when it carries one already: two sources
    would disagree)."""
    if is_sentinel(url):
        s = parse_sentinel(url)
        if s.password is not None:
            raise PasswordGivenTwice("redis_url carries a password")
        return SentinelSet(s.sentinels, s.service, s.db, password).url()
    parts = urlsplit(url)
    if parts.password is not None:
        raise PasswordGivenTwice("redis_url carries a password")
    user = quote(parts.username or "", safe="")
    host = _host(parts.hostname or "")
    netloc = f"{user}:{quote(password, safe='')}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def redacted(url: str) -> str:
    """*url* with any password replaced, for messages and logs."""
    head, sep, tail = url.partition("://")
    if "@" not in tail:
        return url
    auth, _, rest = tail.rpartition("@")
    user = auth.split(":", 1)[0] if ":" in auth else ""
    return f"{head}{sep}{user}:***@{rest}"


def _host(h: str) -> str:
    return f"[{h}]" if ":" in h else h


def _hostport(text: str, url: str) -> tuple[str, int]:
    if text.startswith("["):
        host, _, port = text[1:].partition("]")
        port = port.lstrip(":")
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not host or (port and not port.isdigit()):
        raise RedisUrlInvalid(f"redis_url {redacted(url)!r}: {text!r} is not host:port")
    return host, int(port) if port else SENTINEL_PORT
