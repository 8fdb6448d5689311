"""Helpers shared by the test modules (no tests here): each test module imports what it needs from
here, never from another test module."""
