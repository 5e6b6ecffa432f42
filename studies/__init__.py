"""Studies of the method (quality, speed, memory, attention), each run as python -m studies.NAME."""
