"""Placeholder: see the open issues; nothing is exported yet."""
