"""The ms-swift plugin: ``swift sft --external_plugins <this folder>/plugin.py`` (docs/swift.md)."""
