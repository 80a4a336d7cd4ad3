"""Tests of megazero/checkpoint/: save, load at any layout, consolidate, failed and damaged saves."""
