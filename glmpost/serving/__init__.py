"""Serving: ``glmpost serve`` (SGLang's native API), the SGLang HTTP client and weight sync."""
