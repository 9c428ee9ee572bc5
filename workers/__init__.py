"""Celery workers and the scheduler loop: edges over the drsvc core."""
