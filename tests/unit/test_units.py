"""The one place times are written: the records' ISO 8601 and the Kubernetes API's RFC 3339, both in UTC."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone

from driver.kubeletplugin.kubeclient import api_time
from driver.units import now


def test_records_keep_times_as_iso_8601_in_utc_to_the_second() -> None:
    written = now()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", written)
    assert abs(datetime.fromisoformat(written) - datetime.now(UTC)) < timedelta(minutes=1)


def test_api_times_are_rfc_3339_in_utc_whatever_zone_the_moment_is_in() -> None:
    moment = datetime(2026, 11, 28, 23, 30, 5, 999_999, tzinfo=timezone(timedelta(hours=2)))
    assert api_time(moment) == "2026-11-28T21:30:05Z"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", api_time())
