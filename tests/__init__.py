"""megazero's tests: each folder mirrors a room of the source tree (tests/README.md has the map)."""
