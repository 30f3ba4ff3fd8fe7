"""A batch's time limit: the analysis alone, by an alarm in the process that runs it; Celery's
hard limit a backstop that leaves room for a first build of the model, and the broker's
visibility timeout longer than both (a batch still running is never handed out again)."""

from __future__ import annotations

import time

import pytest
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded

from headatlas.service.config import Settings
from headatlas.workers.app import broker_options, configure
from headatlas.workers.tasks import _deadline, _describe


def test_the_alarm_interrupts_an_analysis_over_its_limit():
    start = time.monotonic()
    with pytest.raises(SoftTimeLimitExceeded) as caught, _deadline(0.05):
        time.sleep(2.0)
    assert time.monotonic() - start < 1.0
    assert "HEADATLAS_TASK_TIME_LIMIT_S" in _describe(caught.value)


def test_the_alarm_is_cleared_after_an_analysis_within_its_limit():
    with _deadline(0.2):
        pass
    time.sleep(0.4)  # an alarm left armed would raise here


@pytest.mark.parametrize("limit", [10.0, 600.0])
def test_celerys_limits_leave_room_for_the_build_and_stay_under_the_visibility_timeout(limit):
    app = Celery("limits")
    settings = Settings(task_time_limit_s=limit)
    configure(app, settings)
    assert app.conf.task_soft_time_limit is None  # it would count the model's build
    assert limit < app.conf.task_time_limit < broker_options(settings)["visibility_timeout"]
