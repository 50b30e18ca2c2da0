"""The inputs: flags, presets and files (YAML, JSON, CSV) turned into validated scenarios. All
reading of user input happens here."""
