"""Readable process titles, so `ps` and `pgrep -f drsvc-worker` find drsvc's processes:
``drsvc-plugin a``, ``drsvc-worker a/n1 control``, ``drsvc-scheduler a``, ``drsvc-metrics a``,
each followed by its config file (PyPI setproctitle). The config path keeps a process
findable by its site's directory, as the lab's leftover scan does.

Celery titles its own processes when setproctitle is importable (``[celeryd: ...]``); a
worker's title is set again once Celery has (worker_ready, worker_process_init)."""
from __future__ import annotations

import setproctitle


def process_label(cfg) -> str:
    """The site, and the storage node of a multi-node site: "a", "a/n1"."""
    return f"{cfg.site}/{cfg.node_id}" if cfg.is_node else cfg.site


def title_for(kind: str, cfg, extra: str = "") -> str:
    words = [f"drsvc-{kind}", process_label(cfg)] + ([extra] if extra else [])
    return " ".join(words) + (f" (config {cfg.path})" if cfg.path else "")


def set_title(kind: str, cfg, extra: str = "") -> str:
    title = title_for(kind, cfg, extra)
    setproctitle.setproctitle(title)
    return title


def keep_worker_titles(kind: str, cfg, extra: str = "") -> None:
    """A Celery worker: its main process and its pool's children keep drsvc's titles."""
    from celery import signals
    main = title_for(kind, cfg, extra)
    setproctitle.setproctitle(main)

    def on_ready(**_):
        setproctitle.setproctitle(main)

    def on_child(**_):
        setproctitle.setproctitle(f"{main} pool")
    signals.worker_ready.connect(on_ready, weak=False)
    signals.worker_process_init.connect(on_child, weak=False)
