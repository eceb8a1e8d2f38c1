"""Known tide gauge stations and helpers to look them up."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Station:
    """A tide gauge station with its id, city and height above sea level."""

    station_id: str
    city: str
    latitude: float
    longitude: float
    height_m: float


# The three stations that tidepool knows out of the box.
KNOWN_STATIONS = {
    "RTM-042": Station("RTM-042", "Rotterdam", 51.905, 4.466, 3.2),
    "VLI-017": Station("VLI-017", "Vlissingen", 51.442, 3.596, 4.8),
    "DZL-008": Station("DZL-008", "Delfzijl", 53.326, 6.933, 2.1),
}


class UnknownStationError(KeyError):
    """Raised when a station id is not in KNOWN_STATIONS."""


def get_station(station_id):
    """Return the Station for `station_id`, or raise UnknownStationError."""
    try:
        return KNOWN_STATIONS[station_id.upper()]
    except KeyError:
        raise UnknownStationError(station_id) from None


def stations_in_city(city):
    """Return a list of all known stations in a city."""
    return [s for s in KNOWN_STATIONS.values() if s.city.lower() == city.lower()]
