"""Deployment: trained heads leave jetflow as folders a serving engine loads (vLLM's ``speculators``)."""
