"""The run's configuration: every key, knob and grid entry validated once, before the model loads."""
