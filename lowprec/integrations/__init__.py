"""Opt-in integrations with training frameworks built on Accelerate (imported explicitly, never by `lowprec`)."""
