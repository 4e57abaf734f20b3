"""Hang detection: phases, heartbeats, the verdict protocol and the watchdog thread."""
