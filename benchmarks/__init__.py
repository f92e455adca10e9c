"""Scripts that print figures (speed, memory); run by hand, never as timed tests."""
