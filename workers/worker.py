"""Celery entry module: `celery -A workers.worker ...` with DRSVC_CONFIG=site.toml.

Used by `celery ... flower` too. The app is built here, at the edge, from the
site config; nothing else creates a Celery app at import time.
"""
import os

from drsvc.config import load

from .app import make_app

app = make_app(load(os.environ["DRSVC_CONFIG"]))
