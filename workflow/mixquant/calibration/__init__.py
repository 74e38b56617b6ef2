"""mixquant.calibration"""
