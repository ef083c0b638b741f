"""What every zeroserve process and the client share."""
