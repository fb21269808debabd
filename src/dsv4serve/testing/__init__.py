"""Test doubles and generators shipped with dsv4serve: replayed NVML answers, synthetic EXL3 packs.

They live in the package (not tests/) so the device probe script and the lead developer's
fixtures can import them from an installed dsv4serve.
"""
