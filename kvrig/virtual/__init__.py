"""The virtual iPhone: a protocol-level emulator that the real pymobiledevice3 client drives.

A usbmuxd-protocol server (`usbmuxd`) fronts one or more `VirtualDevice`s (device.py); each device runs lockdownd with a
generated pair record and real TLS (`lockdownd`, `pairing`) and the services behind it, one module per
service. Device state (apps, containers, crash reports, Developer Mode, the mounted developer disk image) lives
in a folder (`state`). Launched apps run as host processes whose memory the emulator accounts and kills at the
limit (`apprun`, `footprint`, `jetsam_report`). From iOS 17.4 developer services are reached through a tunnel:
`coredevice_proxy` (CDTunnel over lockdown) carries IPv6 to `tunnel_tcp` (the phone's TCP endpoint), whose
ports serve `rsd` (RemoteServiceDiscovery over HTTP/2 + XPC) and the services it lists.

Nothing outside this package imports it except the CLI (`kvrig virtual`), the demo and the tests: the device
layer talks protocols. Import the modules themselves (`kvrig.virtual.host`, `kvrig.virtual.device`): this file
loads nothing, so `kvrig --help` reads `kvrig.virtual.state` without pymobiledevice3.
"""
