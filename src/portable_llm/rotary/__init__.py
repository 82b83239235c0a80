"""Rotary position embedding: rope, its tables and checks, and HF's frequency scalings."""
