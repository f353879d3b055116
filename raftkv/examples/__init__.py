"""Small example state machines built on ``raftkv.statemachine``."""
