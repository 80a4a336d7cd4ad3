"""Tests of megazero/core/: comm (collectives and their byte accounting), streams, the stream sanitizer."""
