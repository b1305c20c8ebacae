"""The device layer: one module per phone service, on pymobiledevice3's asyncio API.

discovery (usbmux list, lockdown session, profile mapping), apps (installation_proxy), files (house_arrest +
AFC: push a bundle with resume, pull), processes (DTX process control), crash (JetsamEvent reports), syslog.
pymobiledevice3's exceptions become kvrig's DeviceError family in `errors`, the one place that knows them.

The same code drives a real iPhone and the virtual one; nothing here imports the emulator or MLX, and
everything is async: the CLI bridges once with `asyncio.run`.
"""
