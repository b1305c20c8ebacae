"""Reading an IORegistry AppleSmartBattery entry as iPhones publish it (`Temperature` in hundredths of a
degree Celsius; `CurrentCapacity` a percentage where `MaxCapacity` is 100, both in mAh on older phones)."""

from __future__ import annotations

from kvrig.device.battery import parse_battery


def test_recent_iphone_entry() -> None:
    entry = {
        "Temperature": 3110,
        "CurrentCapacity": 92,
        "MaxCapacity": 100,
        "AppleRawCurrentCapacity": 2845,
        "IsCharging": True,
        "ExternalConnected": True,
        "FullyCharged": False,
        "Voltage": 4211,
    }
    sample = parse_battery(entry, 1700000000.5)
    assert sample.t == 1700000000.5
    assert sample.temperature_c == 31.1
    assert sample.level_percent == 92
    assert sample.charging is True and sample.external_power is True


def test_older_iphone_reports_capacity_in_mah() -> None:
    sample = parse_battery({"Temperature": 2750, "CurrentCapacity": 1201, "MaxCapacity": 1715}, 0.0)
    assert sample.temperature_c == 27.5
    assert sample.level_percent == 70.03  # 1201 / 1715 mAh
    assert sample.charging is None and sample.external_power is None


def test_missing_or_odd_values_are_unknown_not_zero() -> None:
    sample = parse_battery({"Temperature": "hot", "IsCharging": 1, "CurrentCapacity": True}, 0.0)
    assert sample.temperature_c is None and sample.level_percent is None and sample.charging is None
