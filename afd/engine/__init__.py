"""schedule -> execute -> update: the one generation path of the server and of offline `afd.LLM`."""
