"""Integrations with other training front-ends (they import the library, never the reverse)."""
