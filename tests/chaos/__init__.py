"""The chaos soak: agents through the whole system while processes are SIGKILLed (issue 10)."""
