"""Celery workers and the APScheduler loop: edges over the drsvc core."""
