"""Configuration: `Settings` (the one door to it), routes, the config file, the help text."""
